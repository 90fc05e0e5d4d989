"""One optimizer step's mechanics: forward and backward over the micro-batches (token-weighted
over the data-parallel ranks), the update, and the step's figures in one small all-reduce."""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from omegaconf import DictConfig

from framework.contract import ModelSpec, logits_of
from framework.data import DataPipeline, concat_batches
from framework.dist import DistInfo, all_reduce_sum, host_values
from framework.figures import Registry
from framework.loss import cross_entropy, loss_elements
from framework.measure.metrics import Flops
from framework.optimizers.skip import step_unless
from framework.parallel.apply import Parallelized
from framework.precision import Precision, loss_scale
from framework.run.measurements import Measurements
from framework.run.resilience import faulty


@dataclass
class Parts:
    """What a rank trains with, built once (framework.run.build)."""

    flops: Flops  # per token, counted on the plain model before any sharding
    par: Parallelized  # the module to run, its gradient-sync switch, its data-parallel coordinates
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    data: DataPipeline | None  # None: built without training data (a front door reading a split of its own)
    precision: Precision
    spec: ModelSpec  # what the model declares (framework/contract.py): task, blocks, ...
    n_blocks: int = 0  # the whole model's blocks (a pipeline stage holds some of them)
    converters: dict = field(default_factory=dict)  # entry -> the converter object (framework/converters)

    @property
    def task(self) -> str:  # lm | classify
        return self.spec.task


@dataclass(frozen=True)
class Resumed:
    """Where a run goes on from: its checkpoint's state (a fresh run: the start)."""

    step: int = 0  # optimizer steps done
    data_position: tuple[int, int] = (0, 0)  # (epoch, samples of its order read: framework/data/samplers.py)
    skipped_steps: int = 0  # nonfinite=skip: steps not applied so far
    callbacks: dict = field(default_factory=dict)  # each callback's state_dict, by name
    verify_s: float = 0.0  # seconds spent verifying checkpoints before resuming
    load_s: float = 0.0  # seconds to resume: verifying and loading


@dataclass(frozen=True)
class StepInput:
    """What one optimizer step runs on."""

    batches: list  # (epoch, batch) of each micro-batch
    sampled: bool = False  # measure memory and communication on this step
    fault: str | None = None  # fault injection: HYDRADIST_FAULT's kinds that act in the step (framework.run.resilience)


@dataclass(frozen=True)
class PendingStep:
    """A step just run, whose figures still wait on the device (framework.run.ledger settles them:
    reading them is a host sync, done once per logged step)."""

    values: torch.Tensor  # loss sum, terms, tokens, samples, grad norm, applied, loss scale, registry's figures
    sampled: bool
    started: float  # the host clock when the step began (its batches' reading included)
    lr: float | None = None  # the learning rate the update applied (the first parameter group's)


@dataclass(frozen=True)
class StepFigures:
    """One optimizer step's figures, the same on every rank after one small all-reduce."""

    loss: float
    tokens: int | None
    samples: int
    grad_norm: float
    seconds: float
    sampled: bool  # memory and communication were measured
    applied: bool  # the update was applied (not skipped: non-finite gradients, a callback's request)
    loss_scale: float | None  # amp: the scaler's scale after this step's update
    extra: dict = field(default_factory=dict)  # the registry's figures (framework/figures.py), by name

    @property
    def preempt(self) -> bool:  # some rank got a signal: every rank stops after this step
        return bool(self.extra.get(SIGNAL))

    @classmethod
    def settled(cls, pending: PendingStep, values: list[float], seconds: float, sequence_data: bool,
                figures: Registry) -> StepFigures:  # fmt: skip
        """The figures from `pending`'s values, read (with the other waiting steps') in one sync.
        A step with no loss terms anywhere (every row empty) has no loss: nan, not a division by 0."""
        loss_sum, terms, tokens, samples, grad_norm, applied, scale = values[:CORE]
        return cls(
            loss=loss_sum / terms if terms else math.nan,
            tokens=round(tokens) if sequence_data else None,
            samples=round(samples),
            grad_norm=grad_norm,
            seconds=seconds,
            sampled=pending.sampled,
            applied=applied > 0,
            loss_scale=scale if math.isfinite(scale) else None,
            extra=figures.read(values[CORE:]),
        )

    def view(self) -> dict:
        """The step's figures by name, as callbacks and the registry read them."""
        return {"loss": self.loss, "grad_norm": self.grad_norm, "tokens": self.tokens, "samples": self.samples,
                "step_time_s": self.seconds, "applied": self.applied, "loss_scale": self.loss_scale, **self.extra}  # fmt: skip


CORE = 7  # the step's own values ahead of the registry's (StepFigures.settled)
SIGNAL = "control/signal"  # the loop's own figures (framework.run.trainer): a rank got a signal


def forward_backward(
    cfg: DictConfig, info: DistInfo, parts: Parts, work: StepInput, measure: Measurements,
    before_backward: Callable[[int], None] = lambda micro: None,
) -> torch.Tensor:  # fmt: skip
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
        inputs, kwargs, target = par.split_batch(inputs, target)  # context parallel: this rank's part
        # the schedule divides by its micro-batches, FSDP averages over dp x cp: the global token mean
        weight = par.pipeline.n_microbatches * par.dp_size * par.cp_size / step_elements(cfg, info, parts, step_batches)
        before_backward(0)
        with precision.autocast(), meter.measure() if meter else nullcontext(), par.loss_context():
            amp = loss_scale(precision.scaler, info.device) if precision.scaler.is_enabled() else None
            loss = par.pipeline.step(
                inputs[0], target, kwargs.get("positions"), weight if amp is None else weight * amp
            )
            return loss if amp is None else loss / amp  # its share of the global mean (loss_weight)
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
                if work.fault and micro == 0:  # fault injection (HYDRADIST_FAULT=RANK:STEP:KIND)
                    loss = faulty(loss, work.fault)
            before_backward(micro)
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


def optimizer_step(parts: Parts, grad_clip: float, skip_nonfinite: bool,
                   gate: Callable[[torch.Tensor], bool | torch.Tensor | None] | None = None) -> tuple[torch.Tensor, bool | torch.Tensor]:  # fmt: skip
    """Clip the true (unscaled) gradients by their global norm and step. Returns the norm and
    whether the update was applied: amp's scaler skips steps with inf/nan gradients (and lowers
    its scale); with `skip_nonfinite` so does every precision; `gate(norm)` (the callbacks'
    requests, framework.hooks.Control.skip_update) may skip it outright (True: every rank asked
    alike) or where a device bool holds, decided on the device (framework.optimizers.skip.step_unless).
    The norm is global, so every rank decides the same. Under amp, "applied" is a device bool (the
    scale did not drop): `get_scale()` would be a host sync."""
    applied = getattr(parts.optimizer, "applied_grad_norm", None)  # an optimizer whose update already ran
    if applied is not None:
        return applied(), True
    scaler = parts.precision.scaler
    scaler.unscale_(parts.optimizer)
    norm = parts.par.clip_grad_norm(grad_clip if grad_clip > 0 else float("inf"))
    when = gate(norm) if gate is not None else None
    if when is True:
        if scaler.is_enabled():
            scaler.update()  # closes the step unscale_ opened (the scale moves as its inf check says)
        return norm, False
    if skip_nonfinite and not scaler.is_enabled() and not torch.isfinite(norm):  # a sync, nonfinite=skip only
        return norm, False
    applied: bool | torch.Tensor = True
    if scaler.is_enabled():
        before = loss_scale(scaler, norm.device)
        update = lambda: (scaler.step(parts.optimizer), scaler.update())  # noqa: E731
    else:
        update = parts.optimizer.step
    if when is None:
        update()
    else:
        step_unless(parts.optimizer, when, update, fused=not scaler.is_enabled())
        applied = ~when
    if scaler.is_enabled():
        applied = applied & (loss_scale(scaler, norm.device) >= before)
    return norm, applied


def global_loss(info: DistInfo, parts: Parts, step_batches: list, step_loss: torch.Tensor) -> torch.Tensor:
    """The step's global mean loss on the device, before the update (one small all-reduce; the
    step's figures carry it again after the update): what on_before_update is shown."""
    weight, terms = loss_weight(parts, step_batches)
    totals = all_reduce_sum(torch.cat([(step_loss.detach().float() * weight).reshape(1),
                                       host_values([terms], info.device)]), info)  # fmt: skip
    return totals[0] / totals[1]


def loss_weight(parts: Parts, step_batches: list) -> tuple[float, float]:
    """(weight of this rank's loss, its loss terms) in the step's global mean: one rank per
    data-parallel group (tp peers hold the same loss; cp ranks each a part of the batch they all
    read, counted once); a pipeline's mean loss on the ranks that hold one (its last stage)."""
    par = parts.par
    if par.pipeline is not None:
        return float(par.holds_loss), float(par.holds_loss)
    return float(par.counts_loss), sum(loss_elements(b[1]) for _, b in step_batches) * float(par.counts_data)


def reduce_step_figures(
    info: DistInfo,
    parts: Parts,
    step_batches: list,
    step_loss: torch.Tensor,
    update: tuple[torch.Tensor, bool | torch.Tensor],
    extra: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One small all-reduce for the step's figures: the loss (summed losses over summed loss terms,
    one rank per data-parallel group; a pipeline: the mean over the ranks that hold a loss, its
    last stage), tokens and samples summed over one rank per data-parallel group, and `extra`:
    the registry's figures packed (framework/figures.py: the callbacks' and the model's, the
    loop's own signals). Returns (the step's values: they stay on the device, with the gradient
    norm, whether the update was applied and the loss scale, until framework.run.ledger settles
    them: reading them is a host sync, once per logged step; the registry's part reduced, on the
    device, for post-step updates)."""
    par, data, (grad_norm, applied) = parts.par, parts.data, update
    counting = float(par.counts_data)  # tp, pp and cp peers read the same batch: count it once
    tokens = sum(data.tokens_in(b) or b[1].size(0) for _, b in step_batches) * counting
    samples = sum(b[1].size(0) for _, b in step_batches) * counting
    weight, terms = loss_weight(parts, step_batches)
    counts = host_values([terms, tokens, samples], info.device)
    totals = all_reduce_sum(torch.cat([(step_loss.float() * weight).reshape(1), counts, extra.to(counts)]), info)
    core, figures = totals[:4], totals[4:]
    scaler = parts.precision.scaler
    scale = loss_scale(scaler, core.device) if scaler.is_enabled() else core.new_full((1,), math.nan)
    if isinstance(applied, torch.Tensor):  # amp: a device bool, read with the rest
        applied = applied.reshape(1).to(core.dtype)
    else:
        applied = core.new_full((1,), float(applied))
    norm = grad_norm.detach().float().reshape(1).to(core.device)
    return torch.cat([core, norm, applied, scale.float().reshape(1), figures]), figures
