"""One rank's training run, readable top to bottom: build, loop (accumulate, step, measure, log,
save), summarise. Every rank runs this; rank-0-only work is marked as such."""

from __future__ import annotations

import json
import os
import random
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn
from tqdm import tqdm

from framework import checkpoint
from framework.comm import CommCounter, mean_totals
from framework.config import backend_env, resolve_backend, resolve_device
from framework.data import DataPipeline, build_data, concat_batches
from framework.dist import (
    DistInfo,
    all_gather_object,
    all_reduce_sum,
    destroy_distributed,
    init_distributed,
    restart_count,
)
from framework.loss import cross_entropy, loss_elements
from framework.memory import (
    SavedActivationMeter,
    device_peak_bytes,
    device_reserved_bytes,
    model_state_bytes,
    peak_rss_bytes,
    release_cached_memory,
)
from framework.metrics import ForwardTimer, Throughput, flops_per_token, load_balance, mfu, peak_flops
from framework.optim import build_optimizer, build_scheduler
from framework.parallel import Parallelized, parallelize
from framework.precision import Precision, build_precision
from framework.profiling import build_profiler
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


@dataclass(frozen=True)
class Flops:
    """Training FLOPs per token: the model's (MFU), and with recomputation (HFU); None for models
    that do not count theirs. `devices`: the accelerators (or CPU ranks) the run uses."""

    model: float | None
    hardware: float | None
    devices: int


def count_flops(model: nn.Module, cfg: DictConfig, info: DistInfo) -> Flops:
    seq_len = cfg.data.get("seq_len")
    n_layer = cfg.model.get("n_layer", 0)
    recomputed = -(-n_layer // cfg.memory.checkpoint_every) if cfg.memory.name == "checkpoint" else 0
    # parallel=dp is one process driving every visible GPU
    devices = torch.cuda.device_count() if cfg.parallel.name == "dp" else info.world_size
    return Flops(flops_per_token(model, seq_len), flops_per_token(model, seq_len, recomputed), devices)


@dataclass
class Parts:
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


def build(cfg: DictConfig, info: DistInfo, run_dir: str) -> Parts:
    # The build order. Process group (already up) -> model, from the same seed on every rank so
    # replicas start identical -> parallelize (pipeline split, tensor parallel, activation
    # checkpointing, FSDP/DDP: that order, written once in framework.parallel.parallelize) ->
    # optimizer (over the final, possibly sharded parameters) -> resume -> data (split over the
    # data-parallel ranks the strategy defines) -> precision.
    seed_everything(cfg.seed)
    model_kwargs = {k: v for k, v in OmegaConf.to_container(cfg.model).items() if k != "name"}
    model = build_model(cfg.model.name, **model_kwargs).to(info.device)
    flops = count_flops(model, cfg, info)  # before sharding: every strategy counts the same work
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
    return Parts(flops, par, optimizer, scheduler, data, precision, start_step)


def train(cfg: DictConfig, info: DistInfo, files: RunFiles, choices: dict[str, str]) -> dict[str, Any]:
    # The tracker first: W&B's service starts in the background while the model is built, not
    # while the first steps run (on a small machine it competes with them for the cores).
    tracker = build_tracker(cfg.logger, OmegaConf.to_container(cfg), files.run_dir, choices, info.is_main)
    try:
        parts = build(cfg, info, files.run_dir)
        files.truncate_metrics(parts.start_step)  # a restarted run rewrites the steps after its checkpoint
        summary = loop(cfg, info, parts, files, tracker, choices)
    except BaseException:
        tracker.finish(ok=False)
        raise
    tracker.summary(summary)
    tracker.finish(ok=True)
    if info.is_main:
        report(summary, files.run_dir, tracker)
    return summary


@dataclass
class RunStats:
    """What one rank gathers over the loop, for the summary."""

    losses: list[float]  # global mean loss per step, earlier attempts' steps included
    throughput: Throughput = field(default_factory=Throughput)
    work: list[int] = field(default_factory=list)  # tokens (samples for fixed-size data) per step
    forward_s: list[float] = field(default_factory=list)  # forward seconds per step
    slots: int = 0  # token positions computed, padding included
    comm: list[dict[str, Any]] = field(default_factory=list)  # collectives of each sampled step
    state_bytes: dict[str, int] = field(default_factory=dict)  # parameters, gradients, optimizer
    first_step_s: float | None = None  # the first step's time (compilation included)
    startup_s: float | None = None  # process start to the end of the first optimizer step


@dataclass
class StepFigures:
    """One optimizer step's figures, the same on every rank after one small all-reduce."""

    loss: float
    tokens: int | None
    samples: int
    grad_norm: float
    seconds: float


def loop(cfg: DictConfig, info: DistInfo, parts: Parts, files: RunFiles, tracker: Tracker, choices: dict) -> dict:
    par, data, accum = parts.par, parts.data, cfg.accumulation_steps
    stats = RunStats(losses=list(files.prior_losses))
    meter = SavedActivationMeter(par.module)
    # this rank's forward time per step: compute with no gradient communication in it (DDP and
    # FSDP backward passes end waiting for the slowest rank, so they cannot show imbalance)
    forward_timer = ForwardTimer(info.device)
    peak = peak_flops(info.device, cfg.metrics.peak_tflops, parts.precision.dtype) if parts.flops.model else None
    profiler = build_profiler(cfg.profile, cfg.profiler, files.run_dir, info.rank, info.device)
    batches = data.batches(skip=parts.start_step * accum)
    progress = tqdm(  # rank 0 only
        total=cfg.steps, initial=parts.start_step, disable=not (info.is_main and cfg.progress), dynamic_ncols=True
    )
    par.module.train()
    with profiler:
        for step in range(parts.start_step, cfg.steps):
            inject_fault(step, info)
            t0 = time.perf_counter()
            step_batches = [next(batches) for _ in range(accum)]
            # On a few sampled steps, count every collective (forward, backward, clipping, update)
            # and the bytes saved for backward; both slow the step, so other steps run bare.
            sampled = is_sampled(step, parts.start_step, cfg.steps, cfg.metrics.sample_every)
            counter = CommCounter() if sampled else nullcontext()
            with counter:
                step_loss = forward_backward(cfg, info, parts, step_batches, meter if sampled else None, forward_timer)
                grad_norm = optimizer_step(parts, cfg.optim.grad_clip)
            if sampled:
                stats.state_bytes = model_state_bytes(par.module, parts.optimizer)  # before zero_grad frees grads
                stats.comm.append(counter.totals())
            parts.optimizer.zero_grad(set_to_none=True)
            parts.scheduler.step()
            if cfg.memory.empty_cache_every and (step + 1) % cfg.memory.empty_cache_every == 0:
                release_cached_memory(info.device)

            figures = reduce_step_figures(cfg, info, parts, step_batches, step_loss, grad_norm)
            figures.seconds = time.perf_counter() - t0  # after the all-reduce, a sync point
            record_step(stats, figures, sampled, par.counts_data, data, step_batches, forward_timer)
            if (step + 1) % cfg.metrics.log_every == 0 or step + 1 == cfg.steps:
                log_step(step, figures, stats, parts, peak, sampled, step_batches[-1][0], files, tracker)
            progress.set_postfix(loss=f"{figures.loss:.4f}", refresh=False)
            progress.update(1)
            profiler.step()

            if cfg.checkpoint.every and ((step + 1) % cfg.checkpoint.every == 0 or step + 1 == cfg.steps):
                path = checkpoint_dir(cfg, files.run_dir, step + 1)
                checkpoint.save(path, par.module, parts.optimizer, step + 1)
    progress.close()
    if cfg.checkpoint.export:
        checkpoint.export(os.path.join(files.run_dir, "model.pt"), par, info.is_main)

    summary = summarize(cfg, info, par, choices, stats, meter, parts.flops, peak)
    files.write_summary(summary)  # rank 0 only
    return summary


def forward_backward(
    cfg: DictConfig,
    info: DistInfo,
    parts: Parts,
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
    par, data, precision, accum = parts.par, parts.data, parts.precision, len(step_batches)
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


def optimizer_step(parts: Parts, grad_clip: float) -> torch.Tensor:
    """Clip the true (unscaled) gradients by their global norm and step; returns the norm."""
    scaler = parts.precision.scaler
    scaler.unscale_(parts.optimizer)
    norm = parts.par.clip_grad_norm(grad_clip if grad_clip > 0 else float("inf"))
    scaler.step(parts.optimizer)  # skipped when amp found inf/nan gradients
    scaler.update()
    return norm


def reduce_step_figures(
    cfg: DictConfig, info: DistInfo, parts: Parts, step_batches: list, step_loss: torch.Tensor, grad_norm: torch.Tensor
) -> StepFigures:
    """One small all-reduce for the step's figures: the loss (summed losses over summed loss terms,
    one rank per data-parallel group; a pipeline: the mean over the ranks that hold a loss, its
    last stage), tokens and samples summed over one rank per data-parallel group. `.tolist()` is
    a sync point that ends the step, so the step's time is its true time."""
    par, data = parts.par, parts.data
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
        stats.forward_s.append(forward_timer.take())


def log_step(
    step: int,
    figures: StepFigures,
    stats: RunStats,
    parts: Parts,
    peak: float | None,
    sampled: bool,
    epoch: int,
    files: RunFiles,
    tracker: Tracker,
) -> None:
    """One line of metrics.jsonl and one W&B/TensorBoard step (rank 0 only)."""
    scaler, seconds = parts.precision.scaler, figures.seconds
    tokens_per_s = figures.tokens / seconds if figures.tokens is not None else None
    record = {
        "step": step + 1,
        "loss": figures.loss,
        "lr": parts.scheduler.get_last_lr()[0],
        "grad_norm": figures.grad_norm,
        "step_time_s": seconds,
        "samples_per_s": figures.samples / seconds,
        "tokens_per_s": tokens_per_s,
        "mfu": mfu(parts.flops.model, tokens_per_s, peak, parts.flops.devices),
        "epoch": epoch,
        "loss_scale": scaler.get_scale() if scaler.is_enabled() else None,
        "comm_calls": stats.comm[-1]["calls"] if sampled else None,  # sampled steps
        "comm_bytes": stats.comm[-1]["bytes"] if sampled else None,
    }
    files.log_step(record)
    tracker.log(record, step=step + 1)


def summarize(
    cfg: DictConfig,
    info: DistInfo,
    par: Parallelized,
    choices: dict[str, str],
    stats: RunStats,
    meter: SavedActivationMeter,
    flops: Flops,
    peak: float | None,
) -> dict[str, Any]:
    """The run's summary.json: per-rank figures are the max over ranks (one gather, at the end)."""
    memory_bytes = {**stats.state_bytes, "activation_bytes": meter.peak if stats.state_bytes else None}
    local = {
        **memory_bytes,
        "device_peak_bytes": device_peak_bytes(info.device),
        "device_reserved_bytes": device_reserved_bytes(info.device),
        "rss_peak_bytes": peak_rss_bytes(),
        "comm": mean_totals(stats.comm),
        "work": stats.work,
        "slots": stats.slots,
        "forward": stats.forward_s,
        "startup_s": stats.startup_s,
    }
    everyone = all_gather_object(local, info)
    memory = {k: max(r[k] for r in everyone) if everyone[0].get(k) is not None else None for k in MEMORY_KEYS}
    counting = [r for r in everyone if r["work"]]  # one rank per data-parallel group
    rates = throughput = stats.throughput.rates()
    per_step = stats.throughput.per_step()
    balance = load_balance(
        [r["work"] for r in counting], [r["slots"] for r in counting], [r["forward"] for r in counting]
    )
    if cfg.data.get("pack"):  # packed blocks hold no padding: the unused positions are document boundaries
        balance["boundary_waste"] = balance.pop("padding_waste")
    tokens_per_s = rates["tokens_per_s"]
    achieved = flops.model * tokens_per_s / flops.devices / 1e12 if flops.model and tokens_per_s else None
    return {
        "status": "ok",
        "choices": choices,
        "world_size": info.world_size,
        "parallel_dims": par.mesh.dims.degrees if par.mesh else {"dp": par.dp_size},
        # NCCL_*/GLOO_* knobs as this worker's environment holds them
        "backend_env": {k: os.environ.get(k) for k in backend_env(cfg.backend)},
        "global_batch_size": per_step["samples"],  # samples per optimizer step, as they came
        "per_step": per_step,
        "steps": cfg.steps,
        "first_loss": stats.losses[0] if stats.losses else None,
        "final_loss": stats.losses[-1] if stats.losses else None,
        "throughput": throughput,
        "step_time_s": stats.throughput.median_step_time(),
        "train_time_s": stats.throughput.total_time(),
        "startup_s": max(r["startup_s"] for r in everyone if r["startup_s"] is not None),
        "compile_s": stats.first_step_s if cfg.compile else None,
        "mfu": mfu(flops.model, tokens_per_s, peak, flops.devices),
        "hfu": mfu(flops.hardware, tokens_per_s, peak, flops.devices),
        "flops_per_token": flops.model,
        "peak_tflops_per_device": peak / 1e12 if peak else None,
        "tflops_per_device": achieved,
        "memory": memory,
        # the rank that communicates most (pipeline stages differ), per optimizer step
        "comm": max((r["comm"] for r in everyone if r["comm"]), key=lambda c: c["bytes"], default=None),
        "load_balance": balance,
    }


MEMORY_KEYS = (
    "param_bytes",
    "grad_bytes",
    "optim_bytes",
    "activation_bytes",
    "device_peak_bytes",
    "device_reserved_bytes",
    "rss_peak_bytes",
)


def report(summary: dict[str, Any], run_dir: str, tracker: Tracker) -> None:
    """Rank 0's closing lines: what the run did and where its files are."""
    rate = summary["throughput"]
    speed = f"{rate['tokens_per_s']:.0f} tokens/s" if rate["tokens_per_s"] else f"{rate['samples_per_s']:.1f} samples/s"
    print(
        f"done: {summary['steps']} steps, loss {summary['first_loss']:.4f} -> {summary['final_loss']:.4f}, "
        f"{speed}, {summary['step_time_s'] * 1000:.1f} ms/step on {summary['world_size']} rank(s)\n"
        f"run dir: {run_dir}",
        flush=True,
    )
    if tracker.offline_dir:
        print(
            f"W&B offline run: {tracker.offline_dir}  (upload later with: wandb sync {tracker.offline_dir})",
            flush=True,
        )


def inject_fault(step: int, info: DistInfo) -> None:
    """Fault injection for testing elastic restarts: with HYDRADIST_FAULT="RANK:STEP" in the
    environment, that rank exits abruptly before that step, on the first attempt only."""
    fault = os.environ.get("HYDRADIST_FAULT")
    if fault and restart_count() == 0:
        rank, at = (int(x) for x in fault.split(":"))
        if info.rank == rank and step == at:
            os._exit(17)


def checkpoint_dir(cfg: DictConfig, run_dir: str, step: int) -> str:
    return os.path.join(cfg.checkpoint.dir or os.path.join(run_dir, "checkpoints"), f"step-{step:06d}")


class RunFiles:
    """The run directory's files, written by rank 0 only (other ranks' calls do nothing)."""

    def __init__(self, run_dir: str, info: DistInfo):
        self.run_dir = run_dir
        self.is_main = info.is_main
        self.prior_losses: list[float] = []  # losses of this run's steps before a restart
        if self.is_main:
            os.makedirs(run_dir, exist_ok=True)
            self._metrics = open(os.path.join(run_dir, "metrics.jsonl"), "a")

    def truncate_metrics(self, start_step: int) -> None:
        """Keep only the lines of steps up to `start_step` (what a resumed run already did)."""
        if not self.is_main:
            return
        path = os.path.join(self.run_dir, "metrics.jsonl")
        self._metrics.close()
        with open(path) as f:
            kept = [line for line in f if json.loads(line)["step"] <= start_step]
        with open(path, "w") as f:
            f.writelines(kept)
        self._metrics = open(path, "a")
        self.prior_losses = [json.loads(line)["loss"] for line in kept]

    def log_step(self, record: dict[str, Any]) -> None:
        if self.is_main:
            self._metrics.write(json.dumps(record) + "\n")
            self._metrics.flush()

    def write_summary(self, summary: dict[str, Any]) -> None:
        if self.is_main:
            path = os.path.join(self.run_dir, "summary.json")
            with open(path + ".tmp", "w") as f:
                json.dump(summary, f, indent=2)
            os.replace(path + ".tmp", path)  # never a half-written summary
