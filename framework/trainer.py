"""One rank's training run, readable top to bottom: build, loop (accumulate, step, measure, log,
save), summarise. Every rank runs this; rank-0-only work is marked as such."""

from __future__ import annotations

import json
import os
import random
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
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
from framework.memory import (
    SavedActivationMeter,
    device_peak_bytes,
    device_reserved_bytes,
    model_state_bytes,
    peak_rss_bytes,
    release_cached_memory,
)
from framework.metrics import ForwardTimer, Throughput, compute_imbalance, flops_per_token, mfu, peak_flops
from framework.optim import build_optimizer, build_scheduler
from framework.parallel import Parallelized, parallelize
from framework.precision import Precision, build_precision
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
class Parts:
    """What a rank trains with, built once by `build`."""

    model: nn.Module  # the plain model (FLOPs)
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
    return Parts(model, par, optimizer, scheduler, data, precision, start_step)


def train(cfg: DictConfig, info: DistInfo, files: RunFiles, choices: dict[str, str]) -> dict[str, Any]:
    parts = build(cfg, info, files.run_dir)
    files.truncate_metrics(parts.start_step)  # a restarted run rewrites the steps after its checkpoint
    tracker = build_tracker(cfg.logger, OmegaConf.to_container(cfg), files.run_dir, choices, info.is_main)
    try:
        summary = loop(cfg, info, parts, files, tracker, choices)
    except BaseException:
        tracker.finish(ok=False)
        raise
    tracker.summary(summary)
    tracker.finish(ok=True)
    if info.is_main:
        report(summary, files.run_dir, tracker)
    return summary


def loop(
    cfg: DictConfig,
    info: DistInfo,
    parts: Parts,
    files: RunFiles,
    tracker: Tracker,
    choices: dict[str, str],
) -> dict[str, Any]:
    par, optimizer, scheduler, data, precision = (
        parts.par,
        parts.optimizer,
        parts.scheduler,
        parts.data,
        parts.precision,
    )
    accum = cfg.accumulation_steps
    counts_tokens = cfg.data.name in ("text", "varlen")  # sequence data: report tokens/s
    fpt = flops_per_token(parts.model, cfg.data.get("seq_len"))
    peak = peak_flops(info.device, cfg.metrics.peak_tflops)
    meter = SavedActivationMeter(par.module)
    throughput = Throughput()
    local_work: list[int] = []  # tokens (samples for fixed-size data) per step, data-counting ranks
    losses: list[float] = list(files.prior_losses)
    state_bytes: dict[str, int] = {}
    comm_samples: list[dict[str, Any]] = []  # this rank's collectives on the sampled steps
    local_slots = 0  # token positions computed, padding included (padding waste)
    # this rank's forward time per step: compute with no gradient communication in it (DDP and
    # FSDP backward passes end waiting for the slowest rank, so they cannot show imbalance)
    forward_timer = ForwardTimer(info.device)
    local_forward: list[float] = []
    # Per-rank batch sizes: DDP/FSDP average gradients over ranks, so a rank with n_r of the
    # step's N samples scales its mean loss by n_r x dp / N: the update is the mean over all N.
    sizes = cfg.data.rank_batch_sizes
    loss_weight = sizes[par.dp_rank] * par.dp_size / sum(sizes) if sizes else 1.0

    batches = data.batches(skip=parts.start_step * accum)
    progress = tqdm(  # rank 0 only
        total=cfg.steps,
        initial=parts.start_step,
        disable=not (info.is_main and cfg.progress),
        dynamic_ncols=True,
    )
    par.module.train()
    for step in range(parts.start_step, cfg.steps):
        inject_fault(step, info)
        t0 = time.perf_counter()
        step_batches = [next(batches) for _ in range(accum)]
        epoch = step_batches[-1][0]
        step_work = sum(data.tokens_in(b) or b[1].size(0) for _, b in step_batches)
        step_samples = sum(b[1].size(0) for _, b in step_batches)
        local_slots += sum(data.slots_in(b) or 0 for _, b in step_batches)
        # On a few sampled steps, count every collective (forward, backward, clipping, update)
        # and the bytes saved for backward; both slow the step, so other steps run bare.
        sampled = is_sampled(step, parts.start_step, cfg.steps, cfg.metrics.sample_every)
        comm = CommCounter() if sampled else nullcontext()

        with comm:
            if par.pipeline is None:
                loss_sum = torch.zeros((), device=info.device)
                for micro, (_, batch) in enumerate(step_batches):
                    inputs, target = data.prepare(batch, info.device, non_blocking=cfg.data.pin_memory)
                    measure = meter.measure() if sampled and micro == 0 else nullcontext()
                    # Gradients are synchronised on the last micro-batch only: once per step.
                    with par.grad_sync(micro == accum - 1), par.loss_context():
                        with precision.autocast(), measure, forward_timer:
                            logits = par.module(*inputs)
                            loss = F.cross_entropy(logits.flatten(0, -2).float(), target.flatten())
                        precision.scaler.scale(loss * loss_weight / accum).backward()
                    # under loss parallel the loss is a replicated DTensor: take the plain value
                    loss_sum += (loss.full_tensor() if hasattr(loss, "full_tensor") else loss).detach()
                step_loss = loss_sum / accum
            else:
                # A pipeline runs the step's micro-batches itself, in its schedule's order: the
                # accumulated batches go in as one batch of accumulation_steps x batch_size.
                inputs, target = data.prepare(concat_batches([b for _, b in step_batches]), info.device)
                with precision.autocast(), meter.measure() if sampled else nullcontext():
                    step_loss = par.pipeline.step(inputs[0], target)

            precision.scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
            max_norm = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else float("inf")
            grad_norm = par.clip_grad_norm(max_norm)
            precision.scaler.step(optimizer)  # skipped when amp found inf/nan gradients
            precision.scaler.update()
        if sampled:
            state_bytes = model_state_bytes(par.module, optimizer)  # before zero_grad frees grads
            comm_samples.append(comm.totals())
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        if cfg.memory.empty_cache_every and (step + 1) % cfg.memory.empty_cache_every == 0:
            release_cached_memory(info.device)

        # One small all-reduce for the step's figures: the loss averaged over the ranks that hold
        # one (a pipeline's last stage), work summed over one rank per data-parallel group.
        # `.tolist()` is a sync point that ends the step, so the time below is its true time.
        holds, counts = float(par.holds_loss) * loss_weight, float(par.counts_data)
        figures = torch.tensor([holds, step_work * counts, step_samples * counts], device=info.device)
        local = torch.cat([(step_loss.float() * holds).view(1), figures])
        totals = all_reduce_sum(local, info).tolist()
        loss_value, tokens, samples = totals[0] / totals[1], round(totals[2]), round(totals[3])
        tokens = tokens if counts_tokens else None
        elapsed = time.perf_counter() - t0
        throughput.add(elapsed, samples, tokens, sampled)
        if par.counts_data:
            local_work.append(step_work)
            local_forward.append(forward_timer.take())
        losses.append(loss_value)

        if (step + 1) % cfg.metrics.log_every == 0 or step + 1 == cfg.steps:
            scale = precision.scaler.get_scale() if precision.scaler.is_enabled() else None
            record = {
                "step": step + 1,
                "loss": loss_value,
                "lr": scheduler.get_last_lr()[0],
                "grad_norm": float(grad_norm),
                "step_time_s": elapsed,
                "samples_per_s": samples / elapsed,
                "tokens_per_s": tokens / elapsed if tokens is not None else None,
                "mfu": mfu(fpt, tokens / elapsed if tokens else None, peak, info.world_size),
                "epoch": epoch,
                "loss_scale": scale,
                "comm_calls": comm_samples[-1]["calls"] if sampled else None,  # sampled steps
                "comm_bytes": comm_samples[-1]["bytes"] if sampled else None,
            }
            files.log_step(record)  # rank 0 only
            tracker.log(record, step=step + 1)  # rank 0 only
        progress.set_postfix(loss=f"{loss_value:.4f}", refresh=False)
        progress.update(1)

        if cfg.checkpoint.every and ((step + 1) % cfg.checkpoint.every == 0 or step + 1 == cfg.steps):
            path = checkpoint_dir(cfg, files.run_dir, step + 1)
            checkpoint.save(path, par.module, optimizer, step + 1)
    progress.close()
    if cfg.checkpoint.export:
        checkpoint.export(os.path.join(files.run_dir, "model.pt"), par, info.is_main)

    summary = summarize(
        cfg,
        info,
        par,
        choices,
        losses,
        throughput,
        fpt,
        peak,
        {**state_bytes, "activation_bytes": meter.peak if state_bytes else None},
        mean_totals(comm_samples),
        local_work,
        local_slots,
        local_forward,
    )
    files.write_summary(summary)  # rank 0 only
    return summary


def summarize(
    cfg: DictConfig,
    info: DistInfo,
    par: Parallelized,
    choices: dict[str, str],
    losses: list[float],
    throughput: Throughput,
    fpt: float | None,
    peak: float | None,
    memory_bytes: dict[str, int],
    comm: dict[str, Any] | None,
    local_work: list[int],
    local_slots: int,
    local_forward: list[float],
) -> dict[str, Any]:
    """The run's summary.json: per-rank figures are the max over ranks (one gather, at the end)."""
    local = {
        **memory_bytes,
        "device_peak_bytes": device_peak_bytes(info.device),
        "device_reserved_bytes": device_reserved_bytes(info.device),
        "comm": comm,
        "rss_peak_bytes": peak_rss_bytes(),
        "work": local_work,
        "slots": local_slots,
        "forward": local_forward,
    }
    everyone = all_gather_object(local, info)
    memory_keys = (
        "param_bytes",
        "grad_bytes",
        "optim_bytes",
        "activation_bytes",
        "device_peak_bytes",
        "device_reserved_bytes",
        "rss_peak_bytes",
    )
    memory = {k: max(r[k] for r in everyone) if everyone[0].get(k) is not None else None for k in memory_keys}
    # Load balance over the data-parallel ranks: per step, the busiest rank's work (tokens, or
    # samples for fixed-size data) over the mean, averaged over steps; padding waste: the share
    # of token positions computed on padding.
    counting = [r for r in everyone if r["work"]]
    per_step = list(zip(*(r["work"] for r in counting), strict=True))
    imbalance = sum(max(s) / (sum(s) / len(s)) for s in per_step) / len(per_step) if per_step else None
    slots = sum(r["slots"] for r in counting)
    load_balance = {
        "imbalance": imbalance,
        "max_imbalance": max((max(s) / (sum(s) / len(s)) for s in per_step), default=None),
        "padding_waste": 1 - sum(sum(r["work"]) for r in counting) / slots if slots else None,
        "work_per_rank": [sum(r["work"]) for r in counting],
        # forward seconds per step, busiest rank over mean (steady steps; None for pipelines)
        "compute_imbalance": compute_imbalance([r["forward"] for r in counting]),
        "forward_s_per_rank": [sum(r["forward"]) for r in counting],
    }
    rates = throughput.rates()
    achieved = fpt * rates["tokens_per_s"] / info.world_size / 1e12 if fpt and rates["tokens_per_s"] else None
    return {
        "status": "ok",
        "choices": choices,
        "world_size": info.world_size,
        "parallel_dims": par.mesh.dims.degrees if par.mesh else {"dp": par.dp_size},
        # NCCL_*/GLOO_* knobs as this worker's environment holds them
        "backend_env": {k: os.environ.get(k) for k in backend_env(cfg.backend)},
        "global_batch_size": cfg.data.batch_size * cfg.accumulation_steps * par.dp_size,
        "steps": cfg.steps,
        "first_loss": losses[0] if losses else None,
        "final_loss": losses[-1] if losses else None,
        "throughput": rates,
        "step_time_s": throughput.median_step_time(),
        "train_time_s": throughput.total_time(),
        "mfu": mfu(fpt, rates["tokens_per_s"], peak, info.world_size),
        "tflops_per_device": achieved,
        "memory": memory,
        # the rank that communicates most (pipeline stages differ), per optimizer step
        "comm": max((r["comm"] for r in everyone if r["comm"]), key=lambda c: c["bytes"], default=None),
        "load_balance": load_balance,
    }


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
