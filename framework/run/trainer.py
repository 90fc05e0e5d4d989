"""One rank's training run, readable top to bottom: build (framework.run.build), loop (accumulate,
step, measure, log, save), summarise. Every rank runs this; rank-0-only work is marked as such."""

from __future__ import annotations

import math
import signal
import time
from contextlib import closing
from dataclasses import dataclass, field, replace
from typing import Any

from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from framework.checkpoint import store as checkpoint
from framework.checkpoint.integrity import CheckpointError
from framework.checkpoint.store import Checkpointer, TrainerState
from framework.config import resolve_backend, resolve_device
from framework.dist import DistInfo, destroy_distributed, init_distributed
from framework.export import export_at_end
from framework.measure.memory import (
    current_rss_bytes,
    host_allocator,
    model_state_bytes,
    release_cached_memory,
    reset_peaks,
    set_host_allocator,
)
from framework.moe import routed_layers, set_aux_scale, step_figures
from framework.parallel.dims import Strategy
from framework.run.build import build, build_measurements, generators, layout, resume
from framework.run.evaluation import Evaluator
from framework.run.ledger import Ledger, is_logged, is_sampled, log_step, record_steps, syncs_after
from framework.run.measurements import Measurements
from framework.run.resilience import (
    Aborted,
    Guard,
    NonFiniteLoss,
    Preempted,
    diagnose,
    inject_fault,
    is_collective_failure,
)
from framework.run.run_files import RunFiles, Summary, checkpoint_root
from framework.run.step import (
    Parts,
    PendingStep,
    Resumed,
    StepFigures,
    StepInput,
    forward_backward,
    optimizer_step,
    reduce_step_figures,
)
from framework.run.summary import Given, RunStats, Segment, report, summarize
from framework.tracking import Tracker, build_tracker


def run(cfg: DictConfig, run_dir: str, choices: dict[str, str], started: float | None = None,
        plan_auto: dict[str, Any] | None = None) -> dict[str, Any] | None:  # fmt: skip
    """Train as one rank; returns the run summary on rank 0 (None elsewhere). `started`: when the
    process started (for summary.startup_s); `plan_auto`: parallel=auto's record of its choice
    (summary.plan.auto). Raises `Preempted` after a signal (the checkpoint is saved); a failure
    marks the run aborted for every rank."""
    backend = resolve_backend(cfg) if Strategy.of(cfg.parallel).needs_backend else None
    info = init_distributed(resolve_device(cfg), backend, cfg.backend.timeout_s, cfg.backend.init_method)
    files = RunFiles(run_dir, info)
    try:
        with Guard(info, cfg.checkpoint.preempt_grace_s) as guard:
            try:
                summary = train(cfg, info, files, choices, guard, Given(started, plan_auto))
            except Preempted as stop:
                files.write_summary(Summary("preempted", choices, step=stop.step, checkpoint=stop.path,
                                            signal=signal.Signals(stop.signum).name))  # fmt: skip
                raise
            except Aborted:
                raise  # the failing rank wrote the summary
            except CheckpointError as err:  # every rank has it (a collective verdict): no abort
                files.write_summary(Summary.failed(err, choices))
                raise
            except BaseException as err:
                # any failing rank writes it (rank 0 may be the one left waiting), then tells the others
                files.write_summary(Summary.failed(err, choices), any_rank=True)
                guard.abort(f"{type(err).__name__}: {err}")
                raise
        return summary if info.is_main else None
    finally:
        destroy_distributed()  # on error paths too


def train(cfg: DictConfig, info: DistInfo, files: RunFiles, choices: dict[str, str], guard: Guard,
          given: Given | None = None) -> dict[str, Any]:  # fmt: skip
    given = given or Given()
    set_host_allocator(host_allocator(cfg.memory.host_allocator, cfg.parallel.name))
    import torch._dynamo  # noqa: F401  (the optimizer's first step imports it anyway: count it in the baseline)

    reset_peaks(info.device)  # this run's own peaks (RSS, CUDA allocator), should the process have trained before
    baseline = current_rss_bytes()  # imports and the process group, before the model and W&B
    # The tracker first: W&B's service starts in the background while the model is built, not
    # while the first steps run (on a small machine it competes with them for the cores).
    tracker = build_tracker(cfg.logger, OmegaConf.to_container(cfg), files.run_dir, choices, info.is_main)
    try:
        parts = build(cfg, info)
        resumed = resume(cfg, info, parts, files.run_dir)
        files.truncate_metrics(resumed.step)  # a restarted run rewrites the steps after its checkpoint
        stats = RunStats(losses=list(files.prior_losses), skipped_steps=resumed.skipped_steps,
                         rss_baseline_bytes=baseline, started=given.started, plan_auto=given.plan_auto)  # fmt: skip
        trainer = Trainer(cfg, info, parts, resumed, stats, files, tracker, guard)
        summary = trainer.loop(choices)
        segment = Segment.of(resumed.step, stats.losses[len(files.prior_losses) :])
    except BaseException:
        tracker.finish(ok=False)
        raise
    tracker.summary(summary)
    tracker.finish(ok=True)
    if info.is_main:
        report(summary, segment, files.run_dir, tracker)
    return summary


@dataclass
class Trainer:
    """One rank's training, its parts named: what it trains (`parts`), from where (`resumed`),
    what it gathers (`stats`) and measures (`measure`), where it writes (`files`, `tracker`,
    `saver`), and who tells it to stop (`guard`: signals, a failed peer)."""

    cfg: DictConfig
    info: DistInfo
    parts: Parts
    resumed: Resumed
    stats: RunStats
    files: RunFiles
    tracker: Tracker
    guard: Guard
    measure: Measurements = field(init=False)
    saver: Checkpointer = field(init=False)
    evaluator: Evaluator = field(init=False)
    routed: list = field(init=False, default_factory=list)  # routed MoE layers of this rank, by block

    def __post_init__(self):
        self.measure = build_measurements(self.cfg, self.info, self.parts, self.files.run_dir)
        self.saver = Checkpointer(checkpoint_root(self.cfg, self.files.run_dir), self.info.rank, self.cfg.checkpoint)
        self.evaluator = self.build_evaluator()
        moe = self.parts.moe
        self.routed = routed_layers(self.parts.par.module, moe[0]) if moe else []  # framework/moe.py

    def loop(self, choices: dict[str, str]) -> dict[str, Any]:
        cfg, info, parts, stats = self.cfg, self.info, self.parts, self.stats
        sequence_data = cfg.data.name in ("text", "varlen") or parts.task == "lm"  # report tokens/s
        self.evaluator.at_start(self.tracker)
        batches, ledger = parts.data.batches(*self.resumed.data_position, self.resumed.step), Ledger(sequence_data)
        progress = tqdm(  # rank 0 only
            total=cfg.steps, initial=self.resumed.step, disable=not (info.is_main and cfg.progress), dynamic_ncols=True
        )
        parts.par.module.train()
        with self.measure.profiler, closing(self.saver):
            for step in range(self.resumed.step, cfg.steps):
                if self.run_step(step, batches, ledger, progress):
                    break  # eval.patience: every rank decides alike, after the same step
            if self.saver.pending is not None:  # the last async save: training has ended, but the run waits for it
                t0 = time.perf_counter()
                self.saver.wait()
                stats.checkpoint_s.append(time.perf_counter() - t0)
        stats.checkpoint_io = {"verify_s": self.resumed.verify_s, "load_s": self.resumed.load_s,
                               "failed_saves": self.saver.failed}  # fmt: skip
        progress.close()
        if cfg.checkpoint.export:
            export_at_end(cfg, self.files.run_dir, parts.par, info.is_main)
        figures = summarize(cfg, info, parts, stats, self.measure)
        figures |= {"eval": self.evaluator.summary(), "stopped_early": self.evaluator.stopped_at}
        summary = Summary("ok", choices, figures=figures)
        self.files.write_summary(summary)  # rank 0 only
        return summary.to_dict()

    def run_step(self, step: int, batches: Any, ledger: Ledger, progress: tqdm) -> bool:
        """Run step `step` (0-based); settle, log and save when due. True: stop (eval.patience)."""
        cfg, info, start = self.cfg, self.info, self.resumed.step
        poison = inject_fault(step, info)
        started = ledger.clock()  # the window's time is taken at its sync (framework.run.ledger)
        sampled = is_sampled(step, start, cfg.steps, cfg.metrics.sample_every)
        work = StepInput([next(batches) for _ in range(cfg.accumulation_steps)], sampled, poison)
        try:
            values = self.train_step(step, work)
        except RuntimeError as err:
            if info.distributed and is_collective_failure(err):
                raise diagnose(err, self.guard, step + 1) from None
            raise
        self.measure.forward_timer.end_step()
        if step == start:
            self.guard.shorten_timeout(cfg.backend.step_timeout_s)
        progress.update(1)
        self.measure.profiler.step()
        moe = step_figures(self.routed, *self.parts.moe[1:], info) if self.routed else None
        ledger.add(PendingStep(values, sampled, started, moe), step, work.batches, self.parts.data)
        evaluates = self.evaluator.due(step + 1)
        if not (syncs_after(cfg, step, start) or evaluates):
            return False  # its figures wait on the device (framework.run.ledger): no host sync
        settled = ledger.settle()  # the one host sync of these steps: their window ends here
        val = self.evaluator.after_step(step + 1) if evaluates else None  # after the window: not in throughput
        if val is not None:
            settled[-1].figures = replace(settled[-1].figures, val=val)
        record_steps(self.stats, settled, self.parts.par.counts_data, self.measure.forward_timer)
        if is_logged(cfg, step) or val:
            log_step(settled[-1], self.stats, self.parts, self.measure.peak_flops, self.files, self.tracker)
        progress.set_postfix(loss=f"{settled[-1].figures.loss:.4f}", refresh=False)
        self.end_of_step([e.figures for e in settled], step + 1)
        return self.evaluator.stop

    def train_step(self, step: int, work: StepInput):
        """One optimizer step: forward and backward over the micro-batches, the update (skipped for
        non-finite gradients under nonfinite=skip, or by amp's scaler); returns the step's figures,
        waiting on the device (framework.run.step.reduce_step_figures)."""
        cfg, info, parts = self.cfg, self.info, self.parts
        if self.routed:  # the auxiliary loss's gradient: a micro-batch's share of the step, amp's scale
            share = 1.0 if parts.par.pipeline is not None else 1.0 / len(work.batches)  # pipelines average
            scaler = parts.precision.scaler
            if scaler.is_enabled() and scaler._scale is None:  # made at its first use, which is after this
                scaler._lazy_init_scale_growth_tracker(info.device)
            set_aux_scale(self.routed, scaler._scale * share if scaler.is_enabled() else share)
        with self.measure.sampled_step(work.sampled) as counter:
            step_loss = forward_backward(cfg, info, parts, work, self.measure)
            update = optimizer_step(parts, cfg.optim.grad_clip, skip_nonfinite=cfg.nonfinite == "skip")
        if work.sampled:
            # before zero_grad frees grads; offloaded_bytes: the part held in host memory (FSDP CPU offload)
            self.stats.state_bytes = model_state_bytes(parts.par.module, parts.optimizer, info.device)
            self.stats.comm.append(counter.totals())
        parts.optimizer.zero_grad(set_to_none=True)
        parts.scheduler.step()
        if cfg.memory.empty_cache_every and (step + 1) % cfg.memory.empty_cache_every == 0:
            release_cached_memory(info.device)
        return reduce_step_figures(info, parts, work.batches, step_loss, update, self.guard.requested)

    def end_of_step(self, settled: list[StepFigures], done: int) -> None:
        """After step `done`, the last of the steps just settled: stop on a non-finite step among
        them (nonfinite=stop), save when due, and stop with a checkpoint when any rank got a signal
        (every rank sees it after the same step)."""
        cfg, saver = self.cfg, self.saver
        for k, figures in enumerate(settled):
            bad = not math.isfinite(figures.loss) or (
                not math.isfinite(figures.grad_norm) and not self.parts.precision.scaler.is_enabled()
            )
            if bad and cfg.nonfinite == "stop":
                raise NonFiniteLoss(
                    f"step {done - len(settled) + 1 + k}: loss {figures.loss}, gradient norm {figures.grad_norm} "
                    "(nonfinite=stop; nonfinite=skip leaves such steps out). Last good checkpoint: "
                    f"{checkpoint.latest(saver.root) or 'none (checkpoint.every=0)'}"
                )
        preempt = settled[-1].preempt
        due = cfg.checkpoint.every and (done % cfg.checkpoint.every == 0 or done == cfg.steps)
        if due or preempt:
            t0 = time.perf_counter()
            path = saver.save(
                done, self.parts.par.module, self.parts.optimizer, self.state(done), generators(self.parts)
            )
            self.stats.checkpoint_s.append(time.perf_counter() - t0)  # what training waited for (async: staging)
            self.stats.checkpoint_saves += 1
        if preempt:
            if not saver.wait() or path is None:  # on disk before the process exits
                raise CheckpointError(f"preempted after step {done}; its checkpoint could not be saved (see above)")
            raise Preempted(self.guard.signum or signal.SIGTERM, done, path)

    def state(self, done: int) -> TrainerState:
        """What a checkpoint after step `done` holds besides the model and optimizer."""
        parts = self.parts
        return TrainerState(
            step=done,
            scheduler=parts.scheduler.state_dict(),
            scaler=parts.precision.scaler.state_dict(),
            data=parts.data.position(),
            layout=layout(self.cfg, self.info, parts.par),
            counters={"nonfinite_skipped": self.stats.skipped_steps, "eval": self.evaluator.state},
        )

    def build_evaluator(self) -> Evaluator:
        """Evaluation during training (framework.run.evaluation); with checkpoint.monitor=val_loss it
        keeps one complete checkpoint of the best evaluation under <checkpoint root>/best. The
        resolved config goes beside the checkpoints, for `framework.evaluate` and `framework.generate`."""
        cfg, info, root = self.cfg, self.info, self.saver.root
        if info.is_main and (cfg.checkpoint.every or cfg.checkpoint.monitor):
            checkpoint.write_config(root, OmegaConf.to_container(cfg, resolve=True))
        if not cfg.checkpoint.monitor:
            return Evaluator(cfg, info, self.parts, self.resumed)
        options = OmegaConf.merge(
            cfg.checkpoint, {"keep_last": 1, "async_save": False}
        )  # complete before training goes on
        best = Checkpointer(checkpoint.best_root(root), info.rank, options)

        def save_best(done: int) -> None:  # counted with the run's saves (summary.checkpoint)
            t0 = time.perf_counter()
            best.save(done, self.parts.par.module, self.parts.optimizer, self.state(done), generators(self.parts))
            self.stats.checkpoint_s.append(time.perf_counter() - t0)  # synchronous: training waited for all of it
            self.stats.checkpoint_saves += 1
            self.stats.best_saves += 1

        return Evaluator(cfg, info, self.parts, self.resumed, save_best)
