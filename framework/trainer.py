"""One rank's training run, readable top to bottom: build, loop (accumulate, step, measure, log,
save), summarise. Every rank runs this; rank-0-only work is marked as such."""

from __future__ import annotations

import math
import os
import random
import signal
import time
from contextlib import closing, nullcontext
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from framework import checkpoint
from framework.checkpoint import Checkpointer, TrainerState
from framework.comm import CommCounter
from framework.config import resolve_backend, resolve_device
from framework.contract import build_model, spec_of
from framework.data import build_data
from framework.dist import (
    DistInfo,
    destroy_distributed,
    init_distributed,
    restart_count,
)
from framework.evaluation import Evaluator
from framework.integrity import CheckpointError
from framework.ledger import Ledger, is_logged, is_sampled, log_step, record_steps, syncs_after
from framework.memory import (
    SavedActivationMeter,
    current_rss_bytes,
    host_allocator,
    model_state_bytes,
    release_cached_memory,
    reset_peaks,
    set_host_allocator,
)
from framework.metrics import (
    ForwardTimer,
    count_flops,
    peak_flops,
)
from framework.modules import materialize_model
from framework.optim import build_optimizer, build_scheduler
from framework.parallel import Parallelized, parallelize
from framework.peak import PeakProbe
from framework.precision import build_precision
from framework.profiling import build_profiler
from framework.resilience import (
    Aborted,
    Guard,
    NonFiniteLoss,
    Preempted,
    diagnose,
    inject_fault,
    is_collective_failure,
)
from framework.resume import choose as choose_resume
from framework.run_files import RunFiles, checkpoint_root
from framework.step import Setup, StepFigures, forward_backward, optimizer_step, reduce_step_figures
from framework.summary import RunStats, report, summarize
from framework.tracking import Tracker, build_tracker


def run(cfg: DictConfig, run_dir: str, choices: dict[str, str]) -> dict[str, Any] | None:
    """Train as one rank; returns the run summary on rank 0 (None elsewhere). Raises `Preempted`
    after a signal (the checkpoint is saved); a failure marks the run aborted for every rank."""
    backend = None if cfg.parallel.name in ("none", "dp") else resolve_backend(cfg)
    info = init_distributed(resolve_device(cfg), backend, cfg.backend.timeout_s, cfg.backend.init_method)
    files = RunFiles(run_dir, info)
    try:
        with Guard(info, cfg.checkpoint.preempt_grace_s) as guard:
            try:
                summary = train(cfg, info, files, choices, guard)
            except Preempted as stop:
                files.write_summary({"status": "preempted", "step": stop.step, "checkpoint": stop.path,
                                     "signal": signal.Signals(stop.signum).name, "choices": choices})  # fmt: skip
                raise
            except Aborted:
                raise  # the failing rank wrote the summary
            except CheckpointError as err:  # every rank has it (a collective verdict): no abort
                files.write_summary({"status": "failed", "error": f"CheckpointError: {err}", "choices": choices})
                raise
            except BaseException as err:
                # any failing rank writes it (rank 0 may be the one left waiting), then tells the others
                files.write_summary({"status": "failed", "error": f"{type(err).__name__}: {err}", "choices": choices},
                                    any_rank=True)  # fmt: skip
                guard.abort(f"{type(err).__name__}: {err}")
                raise
        return summary if info.is_main else None
    finally:
        destroy_distributed()  # on error paths too


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def build(cfg: DictConfig, info: DistInfo, run_dir: str) -> Setup:
    # The build order. Process group (already up) -> model, from the same seed on every rank so
    # replicas start identical -> parallelize (pipeline split, tensor parallel, activation
    # checkpointing, FSDP/DDP: that order, written once in framework.parallel.parallelize) ->
    # optimizer (over the final, possibly sharded parameters) -> resume -> data (split over the
    # data-parallel ranks the strategy defines) -> precision.
    seed_everything(cfg.seed)
    meta = build_model(cfg.model, "meta")  # free: the contract is read from it and FLOPs counted on it
    spec = spec_of(meta, cfg.model)
    flops = count_flops(meta, spec, cfg, info.world_size)
    # Models with an init rule (gpt), and pretrained weights, stay on the meta device. Strategies
    # that shard or split them (FSDP2, tensor parallel, pipeline) allocate and fill only this
    # rank's part after parallelizing; the others (none, dp, ddp, FSDP1) the whole model before.
    # Either way the values are the single-process model's (row-seeded: models/init.py). Models
    # without one are built on the device whole, with their own initialisation.
    on_meta = spec.on_meta or cfg.model.get("pretrained") is not None
    late = on_meta and on_mesh(cfg) and not fsdp_v1(cfg)
    if on_meta:
        model = meta
        if not late:
            materialize_model(model, spec, cfg, info.device)
    else:
        seed_everything(cfg.seed)
        model = build_model(cfg.model, info.device)
    decay = {name for name, p in model.named_parameters() if p.dim() >= 2}  # before FSDP1 flattens them
    par = parallelize(model, spec, cfg, info)
    if late:
        materialize_model(par.module, spec, cfg, info.device)
    del model, meta  # the plain model object keeps nothing alive beyond what `par` holds
    optimizer = build_optimizer(par.module, cfg.optim, decay)
    scheduler = build_scheduler(optimizer, cfg.optim, cfg.steps)
    data = build_data(cfg.data, par.dp_rank, par.dp_size, info.device, cfg.seed, spec.task)
    precision = build_precision(cfg.precision, info.device, sharded=fsdp_v1(cfg))
    setup = Setup(flops, par, optimizer, scheduler, data, precision, spec.task)
    # the checkpoint to continue from (checkpoint.resume, or the newest after an elastic restart),
    # verified first: framework/resume.py
    resume, setup.verify_s = choose_resume(cfg, checkpoint_root(cfg, run_dir), info)
    if restart_count() > 0 and info.is_main:
        print(f"restart {restart_count()} of launch.max_restarts={cfg.launch.max_restarts} after a worker failed: "
              f"continuing from {resume or 'the start (no checkpoint yet)'}", flush=True)  # fmt: skip
    if resume:
        t0 = time.perf_counter()
        resume_from(resume, setup, info)
        setup.load_s = setup.verify_s + time.perf_counter() - t0
        if info.is_main:  # a resumed run says so, and from where
            print(f"resumed from step {setup.start_step} (checkpoint {resume})", flush=True)
    return setup


def on_mesh(cfg: DictConfig) -> bool:
    """fsdp, tp, pp and hybrid: laid out on a device mesh (framework.parallel)."""
    return cfg.parallel.name not in ("none", "dp", "ddp")


def fsdp_v1(cfg: DictConfig) -> bool:
    return on_mesh(cfg) and cfg.parallel.get("version", 2) == 1


def generators(setup: Setup) -> dict[str, torch.Generator]:
    """Random generators of this rank beyond the global ones, saved with its RNG state."""
    augment = setup.data.device_transform
    return {"augment": augment.generator} if augment is not None else {}


def layout(cfg: DictConfig, info: DistInfo, par: Parallelized) -> dict[str, Any]:
    return {"parallel": cfg.parallel.name, "world_size": info.world_size, "dp_size": par.dp_size}


def resume_from(path: str, setup: Setup, info: DistInfo) -> None:
    """Continue from checkpoint `path`: model and optimizer (resharded to this layout), the LR
    schedule, the loss scaler, the data position and, on the same layout, every rank's RNG."""
    state, rng = checkpoint.load(path, setup.par.module, setup.optimizer, info.rank)
    data = setup.data
    if state.data["global_batch"] != data.global_batch:
        raise ValueError(
            f"checkpoint.resume: {path} was saved reading {state.data['global_batch']!r} per step "
            f"(parallel={state.layout['parallel']} at {state.layout['world_size']} ranks); this run reads "
            f"{data.global_batch!r}, so the data position cannot map. Keep the global batch: data.batch_size "
            "(or max_tokens, rank_batch_sizes) x data-parallel ranks"
        )
    setup.scheduler.load_state_dict(state.scheduler)
    if state.scaler and setup.precision.scaler.is_enabled():
        setup.precision.scaler.load_state_dict(state.scaler)
    setup.start_step, setup.data_position = state.step, (state.data["epoch"], state.data["offset"])
    setup.skipped_steps = state.counters.get("nonfinite_skipped", 0)
    setup.eval_state = state.counters.get("eval", {})  # the best evaluation so far, for monitor and patience
    same_ranks = (state.layout["world_size"], state.layout["dp_size"]) == (info.world_size, setup.par.dp_size)
    if rng is not None and same_ranks:
        checkpoint.set_rng_state(rng, generators(setup))
    else:  # another layout: per-rank random streams cannot map; start fresh ones, deterministically
        seed_everything(hash((state.step, info.rank)) % 2**31)


def train(cfg: DictConfig, info: DistInfo, files: RunFiles, choices: dict[str, str], guard: Guard) -> dict[str, Any]:
    set_host_allocator(host_allocator(cfg.memory.host_allocator, cfg.parallel.name))
    import torch._dynamo  # noqa: F401  (the optimizer's first step imports it anyway: count it in the baseline)

    reset_peaks(info.device)  # this run's own peaks (RSS, CUDA allocator), should the process have trained before
    baseline = current_rss_bytes()  # imports and the process group, before the model and W&B
    # The tracker first: W&B's service starts in the background while the model is built, not
    # while the first steps run (on a small machine it competes with them for the cores).
    tracker = build_tracker(cfg.logger, OmegaConf.to_container(cfg), files.run_dir, choices, info.is_main)
    try:
        setup = build(cfg, info, files.run_dir)
        files.truncate_metrics(setup.start_step)  # a restarted run rewrites the steps after its checkpoint
        setup.rss_baseline_bytes = baseline
        summary = loop(cfg, info, setup, files, tracker, choices, guard)
    except BaseException:
        tracker.finish(ok=False)
        raise
    tracker.summary(summary)
    tracker.finish(ok=True)
    if info.is_main:
        report(summary, files.run_dir, tracker)
    return summary


def loop(
    cfg: DictConfig, info: DistInfo, setup: Setup, files: RunFiles, tracker: Tracker, choices: dict, guard: Guard
) -> dict:
    par, data, accum = setup.par, setup.data, cfg.accumulation_steps
    stats = RunStats(losses=list(files.prior_losses), skipped_steps=setup.skipped_steps,
                     rss_baseline_bytes=setup.rss_baseline_bytes)  # fmt: skip
    meter = SavedActivationMeter(par.module)
    probe = PeakProbe(par.module, setup.optimizer, meter, info.device)
    # this rank's forward time per step: compute with no gradient communication in it (DDP and
    # FSDP backward passes end waiting for the slowest rank, so they cannot show imbalance)
    forward_timer = ForwardTimer(info.device)
    dtype, tf32 = setup.precision.dtype, setup.precision.tf32
    peak = peak_flops(info.device, cfg.metrics.peak_tflops, dtype, tf32) if setup.flops.model else None
    profiler = build_profiler(cfg.profile, cfg.profiler, files.run_dir, info.rank, info.device)
    saver = Checkpointer(checkpoint_root(cfg, files.run_dir), info.rank, cfg.checkpoint)
    sequence_data = cfg.data.name in ("text", "varlen") or setup.task == "lm"  # report tokens/s
    evaluator = build_evaluator(cfg, info, setup, stats, saver.root)
    evaluator.at_start(tracker)
    batches, ledger = data.batches(*setup.data_position), Ledger(sequence_data)
    progress = tqdm(  # rank 0 only
        total=cfg.steps, initial=setup.start_step, disable=not (info.is_main and cfg.progress), dynamic_ncols=True
    )
    par.module.train()
    with profiler, closing(saver):
        for step in range(setup.start_step, cfg.steps):
            poison = inject_fault(step, info)
            t0 = time.perf_counter()
            step_batches = [next(batches) for _ in range(accum)]
            try:
                figures = train_step(
                    cfg, info, setup, stats, step, step_batches, (meter, forward_timer, probe), poison, guard
                )
            except RuntimeError as err:
                if info.distributed and is_collective_failure(err):
                    raise diagnose(err, guard, step + 1) from None
                raise
            figures.seconds = time.perf_counter() - t0  # the host's time: on CUDA the GPU may still run it
            forward_timer.end_step()
            ledger.add(figures, step, step_batches, data)
            if step == setup.start_step:
                guard.shorten_timeout(cfg.backend.step_timeout_s)
            progress.update(1)
            profiler.step()
            figures.val = evaluator.after_step(step + 1)  # after the step's time is taken: not in throughput
            if not (syncs_after(cfg, step, setup.start_step) or figures.val):
                continue  # its figures wait on the device (framework.ledger): no host sync
            settled = ledger.settle()  # the one host sync of these steps
            record_steps(stats, settled, par.counts_data, forward_timer)
            if is_logged(cfg, step) or figures.val:
                log_step(settled[-1], stats, setup, peak, files, tracker)
            progress.set_postfix(loss=f"{settled[-1].figures.loss:.4f}", refresh=False)
            end_of_step(cfg, info, setup, stats, [e.figures for e in settled], step + 1, saver, guard)
            if evaluator.stop:  # eval.patience: every rank decides alike, after the same step
                break
        if saver.pending is not None:  # the last async save: training has ended, but the run waits for it
            t0 = time.perf_counter()
            saver.wait()
            stats.checkpoint_s.append(time.perf_counter() - t0)
    stats.checkpoint_io = {"verify_s": setup.verify_s, "load_s": setup.load_s, "failed_saves": saver.failed}
    progress.close()
    if cfg.checkpoint.export:
        checkpoint.export(os.path.join(files.run_dir, "model.pt"), par, info.is_main)

    summary = summarize(cfg, info, par, choices, stats, (meter, probe), setup.flops, peak)
    summary |= {"eval": evaluator.summary(), "stopped_early": evaluator.stopped_at}
    files.write_summary(summary)  # rank 0 only
    return summary


def train_step(
    cfg: DictConfig,
    info: DistInfo,
    setup: Setup,
    stats: RunStats,
    step: int,
    step_batches: list,
    timers: tuple[SavedActivationMeter, ForwardTimer, PeakProbe],
    poison: bool,
    guard: Guard,
) -> StepFigures:
    """One optimizer step: forward and backward over the micro-batches, the update (skipped for
    non-finite gradients under nonfinite=skip, or by amp's scaler), and the step's figures."""
    meter, forward_timer, probe = timers
    # On a few sampled steps, count every collective (forward, backward, clipping, update)
    # and the bytes saved for backward; both slow the step, so other steps run bare.
    sampled = is_sampled(step, setup.start_step, cfg.steps, cfg.metrics.sample_every)
    counter = CommCounter() if sampled else nullcontext()
    with counter, probe.watch(counter.in_flight) if sampled else nullcontext():
        step_loss = forward_backward(cfg, info, setup, step_batches, meter if sampled else None, forward_timer, poison)
        grad_norm, applied = optimizer_step(setup, cfg.optim.grad_clip, skip_nonfinite=cfg.nonfinite == "skip")
    if sampled:
        # before zero_grad frees grads; offloaded_bytes: the part held in host memory (FSDP CPU offload)
        stats.state_bytes = model_state_bytes(setup.par.module, setup.optimizer, info.device)
        stats.comm.append(counter.totals())
    setup.optimizer.zero_grad(set_to_none=True)
    setup.scheduler.step()
    if cfg.memory.empty_cache_every and (step + 1) % cfg.memory.empty_cache_every == 0:
        release_cached_memory(info.device)
    figures = reduce_step_figures(cfg, info, setup, step_batches, step_loss, grad_norm, guard.requested)
    figures.sampled, figures.applied = sampled, applied
    return figures


def end_of_step(
    cfg: DictConfig, info: DistInfo, setup: Setup, stats: RunStats, settled: list[StepFigures], done: int,
    saver: Checkpointer, guard: Guard,
) -> None:  # fmt: skip
    """After step `done`, the last of the steps just settled: stop on a non-finite step among them
    (nonfinite=stop), save when due, and stop with a checkpoint when any rank got a signal (every
    rank sees it after the same step)."""
    for k, figures in enumerate(settled):
        bad = not math.isfinite(figures.loss) or (
            not math.isfinite(figures.grad_norm) and not setup.precision.scaler.is_enabled()
        )
        if bad and cfg.nonfinite == "stop":
            raise NonFiniteLoss(
                f"step {done - len(settled) + 1 + k}: loss {figures.loss}, gradient norm {figures.grad_norm} "
                "(nonfinite=stop; nonfinite=skip leaves such steps out). Last good checkpoint: "
                f"{checkpoint.latest(saver.root) or 'none (checkpoint.every=0)'}"
            )
    figures = settled[-1]
    due = cfg.checkpoint.every and (done % cfg.checkpoint.every == 0 or done == cfg.steps)
    if due or figures.preempt:
        state = trainer_state(cfg, info, setup, stats, done)
        t0 = time.perf_counter()
        path = saver.save(done, setup.par.module, setup.optimizer, state, generators(setup))
        stats.checkpoint_s.append(time.perf_counter() - t0)  # what training waited for (async: staging)
        stats.checkpoint_saves += 1
    if figures.preempt:
        if not saver.wait() or path is None:  # on disk before the process exits
            raise CheckpointError(f"preempted after step {done}; its checkpoint could not be saved (see above)")
        raise Preempted(guard.signum or signal.SIGTERM, done, path)


def trainer_state(cfg: DictConfig, info: DistInfo, setup: Setup, stats: RunStats, done: int) -> TrainerState:
    """What a checkpoint after step `done` holds besides the model and optimizer."""
    return TrainerState(
        step=done,
        scheduler=setup.scheduler.state_dict(),
        scaler=setup.precision.scaler.state_dict(),
        data=setup.data.position(),
        layout=layout(cfg, info, setup.par),
        counters={"nonfinite_skipped": stats.skipped_steps, "eval": setup.eval_state},
    )


def build_evaluator(cfg: DictConfig, info: DistInfo, setup: Setup, stats: RunStats, root: str) -> Evaluator:
    """Evaluation during training (framework.evaluation); with checkpoint.monitor=val_loss it
    keeps one complete checkpoint of the best evaluation under <checkpoint root>/best. The
    resolved config goes beside the checkpoints, for `framework.evaluate` and `framework.generate`."""
    if info.is_main and (cfg.checkpoint.every or cfg.checkpoint.monitor):
        checkpoint.write_config(root, OmegaConf.to_container(cfg, resolve=True))
    if not cfg.checkpoint.monitor:
        return Evaluator(cfg, info, setup)
    options = OmegaConf.merge(cfg.checkpoint, {"keep_last": 1, "async_save": False})  # complete before training goes on
    best = Checkpointer(checkpoint.best_root(root), info.rank, options)

    def save_best(done: int) -> None:
        state = trainer_state(cfg, info, setup, stats, done)
        best.save(done, setup.par.module, setup.optimizer, state, generators(setup))

    return Evaluator(cfg, info, setup, save_best)
