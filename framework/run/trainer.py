"""One rank's training run, readable top to bottom: build (framework.run.build), loop (accumulate,
step, measure, log, save), summarise. Every rank runs this; rank-0-only work is marked as such."""

from __future__ import annotations

import signal
import time
from contextlib import closing
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, OmegaConf

from framework.callbacks.build import build_callbacks
from framework.checkpoint import store as checkpoint
from framework.checkpoint.export import export_at_end
from framework.checkpoint.integrity import CheckpointError
from framework.checkpoint.store import Checkpointer, TrainerState
from framework.config import resolve_backend, resolve_device
from framework.data.tokenizer import data_tokenizer
from framework.dist import DistInfo, all_gather_object, destroy_distributed, init_distributed
from framework.figures import Figure
from framework.hooks import CallbackFailure, Callbacks, Control, Rollback, Run, Timings
from framework.measure.memory import (
    current_rss_bytes,
    host_allocator,
    model_state_bytes,
    release_cached_memory,
    reset_peaks,
    set_host_allocator,
)
from framework.optimizers import setting
from framework.parallel.dims import Strategy
from framework.run.build import build, build_measurements, generators, layout, resume, resume_from
from framework.run.ledger import Entry, Ledger, is_logged, is_sampled, log_step, record_steps, syncs_after
from framework.run.measurements import Measurements
from framework.run.resilience import Aborted, Guard, Preempted, damage, diagnose, inject_fault, is_collective_failure
from framework.run.run_files import RunFiles, Summary, checkpoint_root
from framework.run.step import (
    SIGNAL,
    Parts,
    PendingStep,
    Resumed,
    StepInput,
    forward_backward,
    global_loss,
    optimizer_step,
    reduce_step_figures,
)
from framework.run.summary import Given, RunStats, Segment, report, summarize

# The loop's own figures, on the step's all-reduce: any rank's signal or callback request is every rank's
STOP, SAVE = "control/stop", "control/save"
LOOP_FIGURES = [Figure(name, log=False, summary=()) for name in (SIGNAL, STOP, SAVE)]


def run(cfg: DictConfig, run_dir: str, choices: dict[str, str], started: float | None = None,
        plan_auto: dict[str, Any] | None = None) -> dict[str, Any] | None:  # fmt: skip
    """Train as one rank; the run summary on rank 0 (None elsewhere). `started`: the process's start (summary.startup_s);
    `plan_auto`: parallel=auto's record of its choice (summary.plan.auto). Raises `Preempted` after a signal (the
    checkpoint is saved); a failure marks the run aborted for every rank."""
    entered = time.time()  # this worker has started: the launcher's part of summary.launch_s is done
    backend = resolve_backend(cfg) if Strategy.of(cfg.parallel).needs_backend else None
    info = init_distributed(resolve_device(cfg), backend, cfg.backend.timeout_s, cfg.backend.init_method)
    files = RunFiles(run_dir, info)
    try:
        with Guard(info, cfg.checkpoint.preempt_grace_s) as guard:
            try:
                summary = train(cfg, info, files, choices, guard, Given(started, plan_auto, entered))
            except Preempted as stop:
                files.write_summary(Summary("preempted", choices, step=stop.step, checkpoint=stop.path,
                                            signal=signal.Signals(stop.signum).name))  # fmt: skip
                raise
            except Aborted:
                raise  # the failing rank wrote the summary
            except (CheckpointError, CallbackFailure) as err:  # every rank has it (a collective verdict): no abort
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
    # The callbacks first: the loggers' W&B service starts in the background while the model is built
    # (build_callbacks finishes it itself should a callback fail to build)
    callbacks = build_callbacks(cfg, info, files.run_dir, choices)
    try:
        parts = build(cfg, info)
        trainer = Trainer(cfg, info, parts, files, callbacks, guard, started=given.started)
        resumed = trainer.resume()
        stats = RunStats(losses=list(files.prior_losses), skipped_steps=resumed.skipped_steps,
                         rss_baseline_bytes=baseline, **given._asdict())  # fmt: skip
        trainer.stats = stats
        summary = trainer.loop(choices)
    except BaseException as err:
        callbacks.call("on_exception", err)
        raise
    return summary


@dataclass
class Trainer:
    """One rank's training, its parts named: what it trains (`parts`), from where (`resumed`), what it
    gathers (`stats`) and measures (`measure`), where it writes (`files`, `saver`), what watches it
    (`callbacks`, asking through `control`), and who tells it to stop (`guard`: signals, a failed peer).
    The loop below is the order of a step; every capability beside it is a callback (framework/callbacks/)."""

    cfg: DictConfig
    info: DistInfo
    parts: Parts
    files: RunFiles
    callbacks: Callbacks
    guard: Guard
    resumed: Resumed = field(default_factory=Resumed)
    stats: RunStats = field(default_factory=lambda: RunStats(losses=[]))
    measure: Measurements = field(init=False)
    saver: Checkpointer = field(init=False)
    control: Control = field(init=False, default_factory=Control)
    figures: Any = field(init=False)  # the run's figure registry (framework/figures.py)
    prior: int = field(init=False, default=0)  # metrics.jsonl lines of earlier attempts (a resumed run's)
    stopped: dict | None = field(init=False, default=None)  # a callback ended the run early: after which step, why
    started: float | None = None  # when the job started (time.time()), for the callbacks (Run.started)
    timings: Timings = field(init=False, default_factory=Timings)  # seconds by activity (Run.timings)
    faults: set = field(init=False, default_factory=set)  # HYDRADIST_FAULT's fired (once a run)

    def __post_init__(self):
        cfg, info, root = self.cfg, self.info, checkpoint_root(self.cfg, self.files.run_dir)
        self.measure = build_measurements(cfg, info, self.parts, self.files.run_dir)
        self.saver = Checkpointer(root, info.rank, cfg.checkpoint)
        if info.is_main and cfg.checkpoint.every:  # beside the checkpoints, for the front doors (framework.*)
            checkpoint.write_config(root, OmegaConf.to_container(cfg, resolve=True))
        self.figures = self.callbacks.figures
        for figure in LOOP_FIGURES:
            self.figures.declare(figure, "loop", own=True)
        run = Run(cfg, info, self.parts, self.figures, self.control, self.files.run_dir, root, self.started, self.timings,
                  self.log_record, self.save_to, self.callbacks.call, self.callbacks.reach)  # fmt: skip
        self.callbacks.call("on_build", run)

    def resume(self) -> Resumed:
        """Where this run goes on from (framework.run.build.resume), its callbacks' state with it."""
        self.resumed = resume(self.cfg, self.info, self.parts, self.files.run_dir)
        self.timings.add("checkpoint_load", self.resumed.load_s)
        self.files.truncate_metrics(self.resumed.step)  # a restarted run rewrites the steps after its checkpoint
        self.prior = len(self.files.prior_losses)  # the lines of earlier attempts it keeps
        self.callbacks.load_state_dict(self.resumed.callbacks)
        return self.resumed

    def loop(self, choices: dict[str, str]) -> dict[str, Any]:
        cfg, info, parts, stats = self.cfg, self.info, self.parts, self.stats
        sequence_data = cfg.data.name in ("text", "varlen") or parts.task == "lm"  # report tokens/s
        step = self.resumed.step
        self.callbacks.call("on_start", step)
        batches, ledger = parts.data.batches(*self.resumed.data_position, step), Ledger(sequence_data, self.figures)
        parts.par.module.train()
        with closing(self.saver):
            while step < cfg.steps:
                stop = self.run_step(step, batches, ledger)
                step += 1
                if self.control.rollback_to is not None:
                    step, batches = self.rollback(self.control.rollback_to, ledger)
                self.control.clear()
                if stop:
                    self.stopped = {"after_step": step, "by": self.control.stop_reason or "a callback on another rank"}
                    break  # every rank decides alike, after the same step
            if self.saver.pending is not None:  # the last async save: training has ended, but the run waits for it
                t0 = time.perf_counter()
                self.saver.wait()
                stats.checkpoint_s.append(time.perf_counter() - t0)
                self.timings.add("checkpoint_save", stats.checkpoint_s[-1])
        stats.checkpoint_io = {"verify_s": self.resumed.verify_s, "load_s": self.resumed.load_s,
                               "failed_saves": self.saver.failed}  # fmt: skip
        if cfg.checkpoint.export:
            with self.timings.timed("export"):
                export_at_end(cfg, self.files.run_dir, parts.par, info.is_main, data_tokenizer(cfg.data))
        figures = summarize(cfg, info, parts, stats, self.measure, self.figures) | {"stopped": self.stopped}
        summary = Summary("ok", choices, figures=figures)
        if info.is_main:  # the closing lines (the callbacks' own after them: W&B's folder)
            report(summary.figures, Segment.of(self.resumed.step, stats.losses[self.prior :]), self.files.run_dir)
        record = summary.to_dict()
        self.callbacks.call("on_end", record)  # their own blocks join it
        self.files.write_summary(Summary.from_dict(record))  # rank 0 only
        return record

    def run_step(self, step: int, batches: Any, ledger: Ledger) -> bool:
        """Run step `step` (0-based); settle, log and save when due. True: stop (a callback asked)."""
        cfg, info, start = self.cfg, self.info, self.resumed.step
        self.callbacks.call("on_step_start", step)
        fault = inject_fault(step, info, self.parts.par.module, self.faults)
        started = ledger.clock()  # the window's time is taken at its sync (framework.run.ledger)
        sampled = is_sampled(step, start, cfg.steps, cfg.metrics.sample_every)
        with self.timings.timed("data"):
            step_batches = [next(batches) for _ in range(cfg.accumulation_steps)]
        work = StepInput(step_batches, sampled, fault)
        try:
            values, lr = self.train_step(step, work)
        except RuntimeError as err:
            if info.distributed and is_collective_failure(err):
                raise diagnose(err, self.guard, step + 1) from None
            raise
        self.measure.forward_timer.end_step()
        if step == start:
            self.guard.shorten_timeout(cfg.backend.step_timeout_s)
        ledger.add(PendingStep(values, sampled, started, lr), step, work.batches, self.parts.data)
        if not (syncs_after(cfg, step, start) or self.control.sync_requested):
            return False  # its figures wait on the device (framework.run.ledger): no host sync
        settled = ledger.settle()  # the one host sync of these steps: their window ends here
        for entry in settled:  # derived figures, a callback's work: after the window, not in its time
            entry.figures.extra.update(self.callbacks.gather("on_settled", entry.step, entry.figures.view()))
        record_steps(self.stats, settled, self.parts.par.counts_data, self.measure.forward_timer)
        if is_logged(cfg, step) or self.control.log_requested:
            log_step(settled[-1], self.stats, self.parts, self.measure.peak_flops, self.files, self.callbacks)
        return self.end_of_step(settled, step + 1)

    def train_step(self, step: int, work: StepInput):
        """One optimizer step: forward and backward over the micro-batches, the update (skipped for
        non-finite gradients under nonfinite=skip, by amp's scaler, or at a callback's request);
        returns the step's figures, waiting on the device (framework.run.step.reduce_step_figures), and its LR."""
        cfg, info, parts, hooks = self.cfg, self.info, self.parts, self.callbacks
        with self.measure.sampled_step(work.sampled) as counter:
            before_backward = lambda micro: hooks.call("on_before_backward", step, micro)  # noqa: E731
            step_loss = forward_backward(cfg, info, parts, work, self.measure, before_backward)
            hooks.call("on_before_optimizer_step", step)
            gate, clip = self.gate(step, work, step_loss), setting(cfg.optim, "grad_clip")
            update = optimizer_step(parts, clip, cfg.nonfinite == "skip", gate)
        damage(parts.par.module, work.fault)  # fault injection (HYDRADIST_FAULT's `damage`): in the update's weights
        if work.sampled:
            # before zero_grad frees grads; offloaded_bytes: the part held in host memory (FSDP CPU offload)
            self.stats.state_bytes = model_state_bytes(parts.par.module, parts.optimizer, info.device)
            self.stats.comm.append(counter.totals())
        parts.optimizer.zero_grad(set_to_none=True)
        lr = parts.optimizer.param_groups[0]["lr"]  # the LR applied, whoever set it (a callback may)
        parts.scheduler.step()
        if cfg.memory.empty_cache_every and (step + 1) % cfg.memory.empty_cache_every == 0:
            release_cached_memory(info.device)
        theirs = hooks.gather("on_step_end", step)  # their requests so far ride the all-reduce with them
        own = {SIGNAL: float(self.guard.requested), STOP: float(self.control.stop_reason is not None),
               SAVE: float(self.control.save_requested)}  # fmt: skip
        extra = self.figures.pack(theirs | own, info.rank, info.device)
        values, totals = reduce_step_figures(info, parts, work.batches, step_loss, update, extra)
        hooks.call("on_step_reduced", step, self.figures.totals(totals))
        return values, lr

    def gate(self, step: int, work: StepInput, step_loss: Any) -> Any:
        """What decides whether this step's update is skipped, once the gradient norm is known:
        the callbacks' requests (Control.skip_update), on_before_update's among them, shown the
        step's global loss (one small all-reduce, only where a callback defines it) and norm.
        True: skipped (the host decided); a device bool: where it holds; None: applied."""

        def decide(norm: Any) -> Any:
            if self.callbacks.hooks["on_before_update"]:
                loss = global_loss(self.info, self.parts, work.batches, step_loss)
                self.callbacks.call("on_before_update", step, {"loss": loss, "grad_norm": norm})
            return True if self.control.skip_requested else self.control.skip_when

        return decide

    def end_of_step(self, settled: list[Entry], done: int) -> bool:
        """After step `done`, the last of the steps just settled: save when due or asked, and stop
        with a checkpoint when any rank got a signal (every rank sees it after the same step).
        True: a callback asked to stop."""
        cfg, last = self.cfg, settled[-1].figures
        asked = [e.figures.extra for e in settled]
        save = self.control.save_requested or any(f[SAVE] for f in asked)
        due = cfg.checkpoint.every and (done % cfg.checkpoint.every == 0 or done == cfg.steps)
        if self.control.rollback_to is not None:  # this step's state is what the rollback leaves
            due = save = False
            path = checkpoint.latest(self.saver.root) if last.preempt and self.saver.wait() else None
        elif due or save or last.preempt:
            path = self.save_to(self.saver, done)
        if last.preempt:
            if not self.saver.wait() or path is None:  # on disk before the process exits
                raise CheckpointError(f"preempted after step {done}; its checkpoint could not be saved (see above)")
            raise Preempted(self.guard.signum or signal.SIGTERM, done, path)
        return self.control.stop_reason is not None or any(f[STOP] for f in asked)

    def save_to(self, saver: Checkpointer, done: int) -> str | None:
        """A checkpoint after step `done` through `saver` (the run's, or a callback's own), counted
        with the run's saves (summary.checkpoint)."""
        t0 = time.perf_counter()
        path = saver.save(done, self.parts.par.module, self.parts.optimizer, self.state(done), generators(self.parts))
        self.stats.checkpoint_s.append(time.perf_counter() - t0)  # what training waited for (async: staging)
        self.timings.add("checkpoint_save", self.stats.checkpoint_s[-1])
        self.stats.checkpoint_saves += 1
        self.callbacks.call("on_save", done, path)
        return path

    def state(self, done: int) -> TrainerState:
        """What a checkpoint after step `done` holds besides the model and optimizer."""
        parts = self.parts
        return TrainerState(
            step=done,
            scheduler=parts.scheduler.state_dict(),
            scaler=parts.precision.scaler.state_dict(),
            data=parts.data.position(),
            layout=layout(self.cfg, self.info, parts.par),
            counters={"nonfinite_skipped": self.stats.skipped_steps, "callbacks": self.callbacks.state_dict()},
        )

    def log_record(self, record: dict[str, Any], step: int, to_file: bool = True) -> None:
        """A callback's line (to_file=False: to the other callbacks only, e.g. figures before training)."""
        if to_file:
            self.files.log_step({"step": step, **record})
        self.callbacks.call("on_log", step, record)

    def rollback(self, req: Rollback, ledger: Ledger) -> tuple[int, Any]:
        """Go back to the checkpoint `req` names (framework.hooks.Control.rollback) and on from
        there, the data `req.skip_samples` past where it left off (or at `req.data_at`). The steps
        after it are abandoned: their figures waiting in the ledger are dropped, metrics.jsonl and
        the run's losses and figures lose them (the time they took stays in throughput: it was spent)."""
        with self.timings.timed("checkpoint_save"):
            self.saver.wait()
        t0 = time.perf_counter()
        path = self.rollback_path(req)
        if path is None:
            raise CheckpointError("a callback asked to roll back, but the run has no complete checkpoint"
                                  + (f" of step {req.at_most} or earlier" if req.at_most is not None else ""))  # fmt: skip
        back = resume_from(path, self.parts, self.info)
        self.callbacks.load_state_dict(back.callbacks)
        self.callbacks.call("on_rollback", back.step)
        ledger.entries.clear()
        self.files.truncate_metrics(back.step)
        self.stats.rewind(back.step, self.files.prior_losses, back.skipped_steps)
        epoch, samples = req.data_at or (back.data_position[0], back.data_position[1] + req.skip_samples)
        if self.info.is_main:
            print(f"rolled back to step {back.step} ({path}), the data on from epoch {epoch}, sample {samples}",
                  flush=True)  # fmt: skip
        self.timings.add("rollback", time.perf_counter() - t0)
        return back.step, self.parts.data.batches(epoch, samples, back.step)

    def rollback_path(self, req: Rollback) -> str | None:
        """The checkpoint to go back to: rank 0's choice, shared (a save finishing in the background
        can look complete to one rank before another)."""
        if req.path is not None:
            return req.path
        done = [p for p in checkpoint.checkpoints(self.saver.root)
                if req.at_most is None or checkpoint.step_of(p) <= req.at_most]  # fmt: skip
        return all_gather_object(done[-1] if done else None, self.info)[0]
