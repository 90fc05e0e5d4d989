"""One rank's training run, readable top to bottom: build, loop (accumulate, step, measure, log,
save), summarise. Every rank runs this; rank-0-only work is marked as such."""

from __future__ import annotations

import os
import random
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from framework import checkpoint
from framework.comm import CommCounter
from framework.config import resolve_backend, resolve_device
from framework.data import DataPipeline, build_data, concat_batches
from framework.dist import (
    DistInfo,
    all_reduce_sum,
    destroy_distributed,
    init_distributed,
    restart_count,
)
from framework.loss import cross_entropy, loss_elements
from framework.memory import (
    SavedActivationMeter,
    model_state_bytes,
    release_cached_memory,
)
from framework.metrics import (
    Flops,
    ForwardTimer,
    count_flops,
    mfu,
    peak_flops,
)
from framework.optim import build_optimizer, build_scheduler
from framework.parallel import Parallelized, parallelize
from framework.precision import Precision, build_precision
from framework.profiling import build_profiler
from framework.run_files import RunFiles, checkpoint_dir
from framework.summary import RunStats, report, summarize
from framework.tracking import Tracker, build_tracker
from models import build_model


def is_sampled(step: int, start: int, total: int, every: int) -> bool:
    """Steps whose memory and communication are measured (measuring slows a step, so only a few):
    the third step run (the first steady one: DDP re-buckets during the second; the last of a
    shorter run), then every `every` steps. every=0: never."""
    k = step - start
    return every > 0 and (k == min(2, total - start - 1) or (k > 2 and (k - 2) % every == 0))


def run(cfg: DictConfig, run_dir: str, choices: dict[str, str]) -> dict[str, Any] | None:
    """Train as one rank; returns the run summary on rank 0 (None elsewhere)."""
    backend = None if cfg.parallel.name in ("none", "dp") else resolve_backend(cfg)
    info = init_distributed(resolve_device(cfg), backend, cfg.backend.timeout_s, cfg.backend.init_method)
    files = RunFiles(run_dir, info)
    try:
        summary = train(cfg, info, files, choices)
        return summary if info.is_main else None
    except BaseException as err:
        files.write_summary({"status": "failed", "error": f"{type(err).__name__}: {err}", "choices": choices})
        raise
    finally:
        destroy_distributed()  # on error paths too


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


@dataclass
class Setup:
    """What a rank trains with, built once by `build`."""

    flops: Flops  # per token, counted on the plain model before any sharding
    par: Parallelized  # the module to run, its gradient-sync switch, its data-parallel coordinates
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    data: DataPipeline
    precision: Precision
    start_step: int


def restart_checkpoint(cfg: DictConfig, run_dir: str) -> str | None:
    """After the elastic agent restarts the workers (a worker died; launch.max_restarts), the
    run's latest checkpoint, if it saved one: the restarted run continues from there."""
    if restart_count() == 0:
        return None
    return checkpoint.latest(os.path.dirname(checkpoint_dir(cfg, run_dir, 0)))


def build(cfg: DictConfig, info: DistInfo, run_dir: str) -> Setup:
    # The build order. Process group (already up) -> model, from the same seed on every rank so
    # replicas start identical -> parallelize (pipeline split, tensor parallel, activation
    # checkpointing, FSDP/DDP: that order, written once in framework.parallel.parallelize) ->
    # optimizer (over the final, possibly sharded parameters) -> resume -> data (split over the
    # data-parallel ranks the strategy defines) -> precision.
    seed_everything(cfg.seed)
    model_kwargs = {k: v for k, v in OmegaConf.to_container(cfg.model).items() if k != "name"}
    model = build_model(cfg.model.name, **model_kwargs).to(info.device)
    flops = count_flops(model, cfg, info.world_size)  # before sharding: every strategy counts the same work
    par = parallelize(model, cfg, info)
    optimizer = build_optimizer(par.module, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim, cfg.steps)
    start_step = 0
    resume = cfg.checkpoint.resume or restart_checkpoint(cfg, run_dir)
    if resume:
        start_step = checkpoint.load(resume, par.module, optimizer)
        scheduler.last_epoch = start_step - 1
        scheduler.step()  # the learning rate of step `start_step`
    task = "lm" if cfg.model.name == "gpt" else "classify"
    data = build_data(cfg.data, par.dp_rank, par.dp_size, info.device, cfg.seed, task)
    precision = build_precision(cfg.precision, info.device)
    return Setup(flops, par, optimizer, scheduler, data, precision, start_step)


def train(cfg: DictConfig, info: DistInfo, files: RunFiles, choices: dict[str, str]) -> dict[str, Any]:
    # The tracker first: W&B's service starts in the background while the model is built, not
    # while the first steps run (on a small machine it competes with them for the cores).
    tracker = build_tracker(cfg.logger, OmegaConf.to_container(cfg), files.run_dir, choices, info.is_main)
    try:
        setup = build(cfg, info, files.run_dir)
        files.truncate_metrics(setup.start_step)  # a restarted run rewrites the steps after its checkpoint
        summary = loop(cfg, info, setup, files, tracker, choices)
    except BaseException:
        tracker.finish(ok=False)
        raise
    tracker.summary(summary)
    tracker.finish(ok=True)
    if info.is_main:
        report(summary, files.run_dir, tracker)
    return summary


@dataclass
class StepFigures:
    """One optimizer step's figures, the same on every rank after one small all-reduce."""

    loss: float
    tokens: int | None
    samples: int
    grad_norm: float
    seconds: float


def loop(cfg: DictConfig, info: DistInfo, setup: Setup, files: RunFiles, tracker: Tracker, choices: dict) -> dict:
    par, data, accum = setup.par, setup.data, cfg.accumulation_steps
    stats = RunStats(losses=list(files.prior_losses))
    meter = SavedActivationMeter(par.module)
    # this rank's forward time per step: compute with no gradient communication in it (DDP and
    # FSDP backward passes end waiting for the slowest rank, so they cannot show imbalance)
    forward_timer = ForwardTimer(info.device)
    peak = peak_flops(info.device, cfg.metrics.peak_tflops, setup.precision.dtype) if setup.flops.model else None
    profiler = build_profiler(cfg.profile, cfg.profiler, files.run_dir, info.rank, info.device)
    batches = data.batches(skip=setup.start_step * accum)
    progress = tqdm(  # rank 0 only
        total=cfg.steps, initial=setup.start_step, disable=not (info.is_main and cfg.progress), dynamic_ncols=True
    )
    par.module.train()
    with profiler:
        for step in range(setup.start_step, cfg.steps):
            inject_fault(step, info)
            t0 = time.perf_counter()
            step_batches = [next(batches) for _ in range(accum)]
            # On a few sampled steps, count every collective (forward, backward, clipping, update)
            # and the bytes saved for backward; both slow the step, so other steps run bare.
            sampled = is_sampled(step, setup.start_step, cfg.steps, cfg.metrics.sample_every)
            counter = CommCounter() if sampled else nullcontext()
            with counter:
                step_loss = forward_backward(cfg, info, setup, step_batches, meter if sampled else None, forward_timer)
                grad_norm = optimizer_step(setup, cfg.optim.grad_clip)
            if sampled:
                stats.state_bytes = model_state_bytes(par.module, setup.optimizer)  # before zero_grad frees grads
                stats.comm.append(counter.totals())
            setup.optimizer.zero_grad(set_to_none=True)
            setup.scheduler.step()
            if cfg.memory.empty_cache_every and (step + 1) % cfg.memory.empty_cache_every == 0:
                release_cached_memory(info.device)

            figures = reduce_step_figures(cfg, info, setup, step_batches, step_loss, grad_norm)
            figures.seconds = time.perf_counter() - t0  # after the all-reduce, a sync point
            record_step(stats, figures, sampled, par.counts_data, data, step_batches, forward_timer)
            if (step + 1) % cfg.metrics.log_every == 0 or step + 1 == cfg.steps:
                log_step(step, figures, stats, setup, peak, sampled, step_batches[-1][0], files, tracker)
            progress.set_postfix(loss=f"{figures.loss:.4f}", refresh=False)
            progress.update(1)
            profiler.step()

            if cfg.checkpoint.every and ((step + 1) % cfg.checkpoint.every == 0 or step + 1 == cfg.steps):
                path = checkpoint_dir(cfg, files.run_dir, step + 1)
                checkpoint.save(path, par.module, setup.optimizer, step + 1)
    progress.close()
    if cfg.checkpoint.export:
        checkpoint.export(os.path.join(files.run_dir, "model.pt"), par, info.is_main)

    summary = summarize(cfg, info, par, choices, stats, meter, setup.flops, peak)
    files.write_summary(summary)  # rank 0 only
    return summary


def forward_backward(
    cfg: DictConfig,
    info: DistInfo,
    setup: Setup,
    step_batches: list,
    meter: SavedActivationMeter | None,
    forward_timer: ForwardTimer,
) -> torch.Tensor:
    """Forward and backward over the step's micro-batches; returns this rank's summed loss (a
    pipeline: its mean loss).

    The step's loss is the mean over every loss term (token, or sample) of the step on every
    data-parallel rank, however they are split: one all-reduce of the step's term count N before
    backward, then each rank backpropagates its summed loss x dp / N. DDP and FSDP average
    gradients over the dp ranks, so the update is the gradient of the global mean, as one process
    on the union of the ranks' batches would compute it (a rank with fewer real tokens, or a
    smaller `rank_batch_sizes` batch, weighs less)."""
    par, data, precision, accum = setup.par, setup.data, setup.precision, len(step_batches)
    if par.pipeline is not None:
        # A pipeline runs the step's micro-batches itself, in its schedule's order: the
        # accumulated batches go in as one batch of accumulation_steps x batch_size.
        inputs, target = data.prepare(concat_batches([b for _, b in step_batches]), info.device)
        with precision.autocast(), meter.measure() if meter else nullcontext():
            return par.pipeline.step(inputs[0], target)
    scale = par.dp_size / step_elements(cfg, info, par, step_batches)
    loss_sum = torch.zeros((), device=info.device)
    for micro, (_, batch) in enumerate(step_batches):
        inputs, target = data.prepare(batch, info.device, non_blocking=cfg.data.pin_memory)
        measure = meter.measure() if meter and micro == 0 else nullcontext()
        # Gradients are synchronised on the last micro-batch only: once per step.
        with par.grad_sync(micro == accum - 1), par.loss_context():
            with precision.autocast(), measure, forward_timer:
                loss = cross_entropy(par.module(*inputs), target, reduction="sum")
            precision.scaler.scale(loss * scale).backward()
        # under loss parallel the loss is a replicated DTensor: take the plain value
        loss_sum += (loss.full_tensor() if hasattr(loss, "full_tensor") else loss).detach()
    return loss_sum


def step_elements(cfg: DictConfig, info: DistInfo, par: Parallelized, step_batches: list) -> int:
    """The step's loss terms over all data-parallel ranks. Fixed-size data knows it from the
    config; variable-length data counts it with one small all-reduce (a sync point)."""
    if cfg.data.name != "varlen":  # every target counts: seq_len per sample (text), or 1
        per_sample = cfg.data.seq_len if cfg.model.name == "gpt" else 1
        sizes = cfg.data.rank_batch_sizes or [cfg.data.batch_size] * par.dp_size
        return sum(sizes) * len(step_batches) * per_sample
    local = sum(loss_elements(batch[1]) for _, batch in step_batches) if par.counts_data else 0
    return int(all_reduce_sum(torch.tensor(local, device=info.device), info).item())


def optimizer_step(setup: Setup, grad_clip: float) -> torch.Tensor:
    """Clip the true (unscaled) gradients by their global norm and step; returns the norm."""
    scaler = setup.precision.scaler
    scaler.unscale_(setup.optimizer)
    norm = setup.par.clip_grad_norm(grad_clip if grad_clip > 0 else float("inf"))
    scaler.step(setup.optimizer)  # skipped when amp found inf/nan gradients
    scaler.update()
    return norm


def reduce_step_figures(
    cfg: DictConfig, info: DistInfo, setup: Setup, step_batches: list, step_loss: torch.Tensor, grad_norm: torch.Tensor
) -> StepFigures:
    """One small all-reduce for the step's figures: the loss (summed losses over summed loss terms,
    one rank per data-parallel group; a pipeline: the mean over the ranks that hold a loss, its
    last stage), tokens and samples summed over one rank per data-parallel group. `.tolist()` is
    a sync point that ends the step, so the step's time is its true time."""
    par, data = setup.par, setup.data
    counting = float(par.counts_data)  # tp and pp peers read the same batch: count it once
    tokens = sum(data.tokens_in(b) or b[1].size(0) for _, b in step_batches) * counting
    samples = sum(b[1].size(0) for _, b in step_batches) * counting
    if par.pipeline is None:
        terms = sum(loss_elements(b[1]) for _, b in step_batches) * counting
        local = torch.stack([step_loss.float() * counting, step_loss.new_tensor(terms, dtype=torch.float32)])
    else:
        holds = float(par.holds_loss)
        local = torch.stack([step_loss.float() * holds, step_loss.new_tensor(holds, dtype=torch.float32)])
    local = torch.cat([local, local.new_tensor([tokens, samples])])
    totals = all_reduce_sum(local, info).tolist()
    sequence_data = cfg.data.name in ("text", "varlen")  # report tokens/s
    return StepFigures(
        loss=totals[0] / totals[1],
        tokens=round(totals[2]) if sequence_data else None,
        samples=round(totals[3]),
        grad_norm=float(grad_norm),
        seconds=0.0,
    )


def record_step(
    stats: RunStats,
    figures: StepFigures,
    sampled: bool,
    counts_data: bool,
    data: DataPipeline,
    step_batches: list,
    forward_timer: ForwardTimer,
) -> None:
    stats.throughput.add(figures.seconds, figures.samples, figures.tokens, sampled)
    stats.losses.append(figures.loss)
    if stats.first_step_s is None:
        stats.first_step_s = figures.seconds
        stats.startup_s = time.time() - float(os.environ.get("HYDRADIST_START", time.time()))
    if counts_data:
        stats.work.append(sum(data.tokens_in(b) or b[1].size(0) for _, b in step_batches))
        stats.slots += sum(data.slots_in(b) or 0 for _, b in step_batches)
        stats.forward_s.append(forward_timer.pop_seconds())


def log_step(
    step: int,
    figures: StepFigures,
    stats: RunStats,
    setup: Setup,
    peak: float | None,
    sampled: bool,
    epoch: int,
    files: RunFiles,
    tracker: Tracker,
) -> None:
    """One line of metrics.jsonl and one W&B/TensorBoard step (rank 0 only)."""
    scaler, seconds = setup.precision.scaler, figures.seconds
    tokens_per_s = figures.tokens / seconds if figures.tokens is not None else None
    record = {
        "step": step + 1,
        "loss": figures.loss,
        "lr": setup.scheduler.get_last_lr()[0],
        "grad_norm": figures.grad_norm,
        "step_time_s": seconds,
        "samples_per_s": figures.samples / seconds,
        "tokens_per_s": tokens_per_s,
        "mfu": mfu(setup.flops.model, tokens_per_s, peak, setup.flops.devices),
        "epoch": epoch,
        "loss_scale": scaler.get_scale() if scaler.is_enabled() else None,
        "comm_calls": stats.comm[-1]["calls"] if sampled else None,  # sampled steps
        "comm_bytes": stats.comm[-1]["bytes"] if sampled else None,
    }
    files.log_step(record)
    tracker.log(record, step=step + 1)


def inject_fault(step: int, info: DistInfo) -> None:
    """Fault injection for testing elastic restarts: with HYDRADIST_FAULT="RANK:STEP" in the
    environment, that rank exits abruptly before that step, on the first attempt only."""
    fault = os.environ.get("HYDRADIST_FAULT")
    if fault and restart_count() == 0:
        rank, at = (int(x) for x in fault.split(":"))
        if info.rank == rank and step == at:
            os._exit(17)
