"""One optimizer step's mechanics: forward and backward over the micro-batches (token-weighted
over the data-parallel ranks), the update, and the step's figures in one small all-reduce."""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from omegaconf import DictConfig

from framework.contract import logits_of
from framework.data import DataPipeline, concat_batches
from framework.dist import DistInfo, all_reduce_sum, host_values
from framework.loss import cross_entropy, loss_elements
from framework.measure.metrics import Flops
from framework.parallel import Parallelized
from framework.precision import Precision
from framework.run.measurements import Measurements


@dataclass
class Parts:
    """What a rank trains with, built once (framework.run.build)."""

    flops: Flops  # per token, counted on the plain model before any sharding
    par: Parallelized  # the module to run, its gradient-sync switch, its data-parallel coordinates
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    data: DataPipeline
    precision: Precision
    task: str = "lm"  # the model's (framework/contract.py): lm | classify
    moe: tuple[str, int, int, int] | None = (
        None  # routed experts: (blocks path, blocks, experts, copies) (framework/moe.py)
    )


@dataclass(frozen=True)
class Resumed:
    """Where a run goes on from: its checkpoint's state (a fresh run: the start)."""

    step: int = 0  # optimizer steps done
    data_position: tuple[int, int] = (0, 0)  # (epoch, samples of its order read: framework/data/samplers.py)
    skipped_steps: int = 0  # nonfinite=skip: steps not applied so far
    eval_state: dict = field(default_factory=dict)  # best val_loss and its step, evaluations since
    verify_s: float = 0.0  # seconds spent verifying checkpoints before resuming
    load_s: float = 0.0  # seconds to resume: verifying and loading


@dataclass(frozen=True)
class StepInput:
    """What one optimizer step runs on."""

    batches: list  # (epoch, batch) of each micro-batch
    sampled: bool = False  # measure memory and communication on this step
    poison: bool = False  # fault injection (HYDRADIST_FAULT=RANK:STEP:nan): a nan loss


@dataclass(frozen=True)
class PendingStep:
    """A step just run, whose figures still wait on the device (framework.run.ledger settles them:
    reading them is a host sync, done once per logged step)."""

    values: torch.Tensor  # loss sum, terms, tokens, samples, signalled, grad norm, applied, loss scale[, sources]
    sampled: bool
    started: float  # the host clock when the step began (its batches' reading included)
    moe: dict | None = None  # routed experts' figures of the step (framework/moe.py)


@dataclass(frozen=True)
class StepFigures:
    """One optimizer step's figures, the same on every rank after one small all-reduce."""

    loss: float
    tokens: int | None
    samples: int
    grad_norm: float
    seconds: float
    preempt: bool  # some rank got a signal: every rank stops after this step
    sampled: bool  # memory and communication were measured
    applied: bool  # the update was applied (not skipped for non-finite gradients)
    loss_scale: float | None  # amp: the scaler's scale after this step's update
    val: dict | None = None  # an evaluation after this step (run after its window's sync: not in its time)
    sources: tuple[float, ...] = ()  # a mixture: samples of each source, then tokens of each (all ranks)
    moe: dict | None = None  # routed experts: load imbalance, auxiliary loss, dropped tokens

    @classmethod
    def settled(cls, pending: PendingStep, values: list[float], seconds: float, sequence_data: bool) -> StepFigures:
        """The figures from `pending`'s values, read (with the other waiting steps') in one sync."""
        loss_sum, terms, tokens, samples, signalled, grad_norm, applied, scale = values[:8]
        return cls(
            loss=loss_sum / terms,
            tokens=round(tokens) if sequence_data else None,
            samples=round(samples),
            grad_norm=grad_norm,
            seconds=seconds,
            preempt=signalled > 0,
            sampled=pending.sampled,
            applied=applied > 0,
            loss_scale=scale if math.isfinite(scale) else None,
            sources=tuple(round(v) for v in values[8:]),
            moe=pending.moe,
        )


def forward_backward(
    cfg: DictConfig, info: DistInfo, parts: Parts, work: StepInput, measure: Measurements
) -> torch.Tensor:
    """Forward and backward over the step's micro-batches; returns this rank's summed loss (a
    pipeline: its mean loss).

    The step's loss is the mean over every loss term (token, or sample) of the step on every
    data-parallel rank, however they are split: one all-reduce of the step's term count N before
    backward, then each rank backpropagates its summed loss x dp / N. DDP and FSDP average
    gradients over the dp ranks, so the update is the gradient of the global mean, as one process
    on the union of the ranks' batches would compute it (a rank with fewer real tokens, or a
    smaller `rank_batch_sizes` batch, weighs less)."""
    par, data, precision, step_batches = parts.par, parts.data, parts.precision, work.batches
    meter, accum = measure.meter if work.sampled else None, len(step_batches)
    if par.pipeline is not None:
        # A pipeline runs the step's micro-batches itself, in its schedule's order: the
        # accumulated batches go in as one batch of accumulation_steps x batch_size.
        cuda = info.device.type == "cuda"  # from pinned memory, the copy does not wait for the GPU
        inputs, target = data.prepare(concat_batches([b for _, b in step_batches], cuda), info.device, cuda)
        with precision.autocast(), meter.measure() if meter else nullcontext():
            return par.pipeline.step(inputs[0], target)
    scale = par.dp_size * par.cp_size / step_elements(cfg, info, parts, step_batches)  # FSDP averages over dp x cp
    loss_sum = torch.zeros((), device=info.device)
    for micro, (_, batch) in enumerate(step_batches):
        inputs, target = data.prepare(batch, info.device)  # non-blocking from the loader's pinned memory
        inputs, kwargs, target = par.split_batch(inputs, target)  # context parallel: this rank's part
        saved = meter.measure() if meter and micro == 0 else nullcontext()
        # Gradients are synchronised on the last micro-batch only: once per step.
        with par.grad_sync(micro == accum - 1), par.loss_context():
            with precision.autocast(), saved, measure.forward_timer:
                loss = cross_entropy(logits_of(par.module(*inputs, **kwargs)), target, reduction="sum")
                if work.poison:  # fault injection (HYDRADIST_FAULT=RANK:STEP:nan)
                    loss = loss * float("nan")
            precision.scaler.scale(loss * scale).backward()
        # under loss parallel the loss is a replicated DTensor: take the plain value
        loss_sum += (loss.full_tensor() if hasattr(loss, "full_tensor") else loss).detach()
    return loss_sum


def step_elements(cfg: DictConfig, info: DistInfo, parts: Parts, step_batches: list) -> int | torch.Tensor:
    """The step's loss terms over all data-parallel ranks. Fixed-size data knows it from the
    config; variable-length (and the user's own) data counts it with one small all-reduce (a
    device tensor: the loss is scaled by it without a host sync)."""
    # every target counts (seq_len a sample, or 1) where the data has no ignored targets and the
    # batch is the config's; else (padding, document boundaries, prompts, a curriculum) counted
    full = cfg.data.name in ("text", "images", "vectors") or (cfg.data.name == "tokens" and not cfg.data.pack)
    if full and not (cfg.data.get("batch_schedule") or cfg.data.get("seq_len_schedule")):
        per_sample = cfg.data.seq_len if parts.task == "lm" else 1
        sizes = cfg.data.rank_batch_sizes or [cfg.data.batch_size] * parts.par.dp_size
        return sum(sizes) * len(step_batches) * per_sample
    local = sum(loss_elements(batch[1]) for _, batch in step_batches) if parts.par.counts_data else 0
    return all_reduce_sum(host_values([local], info.device), info)[0]


def optimizer_step(parts: Parts, grad_clip: float, skip_nonfinite: bool) -> tuple[torch.Tensor, bool | torch.Tensor]:
    """Clip the true (unscaled) gradients by their global norm and step. Returns the norm and
    whether the update was applied: amp's scaler skips steps with inf/nan gradients (and lowers
    its scale); with `skip_nonfinite` so does every precision. The norm is global, so every
    rank decides the same. Under amp, "applied" is a device bool (the scale did not drop):
    `get_scale()` would be a host sync."""
    scaler = parts.precision.scaler
    scaler.unscale_(parts.optimizer)
    norm = parts.par.clip_grad_norm(grad_clip if grad_clip > 0 else float("inf"))
    if scaler.is_enabled():
        before = scaler._scale.clone()
        scaler.step(parts.optimizer)
        scaler.update()
        return norm, scaler._scale >= before
    if skip_nonfinite and not torch.isfinite(norm):  # a sync point, under nonfinite=skip only
        return norm, False
    parts.optimizer.step()
    return norm, True


def reduce_step_figures(
    info: DistInfo,
    parts: Parts,
    step_batches: list,
    step_loss: torch.Tensor,
    update: tuple[torch.Tensor, bool | torch.Tensor],
    signalled: bool,
) -> torch.Tensor:
    """One small all-reduce for the step's figures: the loss (summed losses over summed loss terms,
    one rank per data-parallel group; a pipeline: the mean over the ranks that hold a loss, its
    last stage), tokens and samples summed over one rank per data-parallel group, and whether any
    rank got a signal. The figures stay on the device (`pending`, with the gradient norm and the
    loss scale, and whether the update was applied: `update`, optimizer_step's answer) until
    framework.run.ledger settles them: reading them is a host sync, once per logged step."""
    par, data, (grad_norm, applied) = parts.par, parts.data, update
    counting = float(par.counts_data)  # tp, pp and cp peers read the same batch: count it once
    tokens = sum(data.tokens_in(b) or b[1].size(0) for _, b in step_batches) * counting
    samples = sum(b[1].size(0) for _, b in step_batches) * counting
    if par.pipeline is None:
        terms = sum(loss_elements(b[1]) for _, b in step_batches) * counting
        # cp ranks each hold a part of the loss of the batch they all read (counted once)
        weight, terms = float(par.counts_loss), terms
    else:
        weight = terms = float(par.holds_loss)
    counts = host_values([terms, tokens, samples, float(signalled)], info.device)
    sources = data.take_source_counts(len(step_batches))  # a mixture's, rides on the same all-reduce
    sources = host_values((sources * counting).tolist(), info.device) if sources is not None else counts[:0]
    totals = all_reduce_sum(torch.cat([(step_loss.float() * weight).reshape(1), counts, sources]), info)
    totals, sources = totals[:5], totals[5:]
    scaler = parts.precision.scaler
    scale = scaler._scale.reshape(1).float() if scaler.is_enabled() else totals.new_full((1,), math.nan)
    if isinstance(applied, torch.Tensor):  # amp: a device bool, read with the rest
        applied = applied.reshape(1).to(totals.dtype)
    else:
        applied = totals.new_full((1,), float(applied))
    return torch.cat([totals, grad_norm.detach().float().reshape(1).to(totals.device), applied, scale, sources])
