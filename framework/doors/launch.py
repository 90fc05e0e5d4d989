"""Start the run: validate, then either train here (already a worker) or start local workers.

Three ways a process reaches ``main``:
- ``python train.py`` on a workstation: start ``launch.nproc_per_node`` workers (torch's elastic
  launcher, forked from a forkserver: framework.machine), wait, report;
- ``torchrun ... train.py`` (also ``srun torchrun``): RANK and WORLD_SIZE are set: train here;
- ``srun python train.py`` with several tasks (SLURM_PROCID set, RANK absent): this task is rank
  SLURM_PROCID, the torch.distributed variables derived from SLURM's;
- ``parallel=none``: one process, no process group: train in this process.
"""

from __future__ import annotations

import logging
import math
import os
import shlex
import signal
import sys
from dataclasses import dataclass
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from framework.checkpoint.integrity import CheckpointError
from framework.checkpoint.runlock import FolderInUse, RunLock
from framework.config import ConfigError, backend_env, resolve_backend, resolve_nproc, validate, world_size_of
from framework.config.run_folder import discard_refused
from framework.data import DataError
from framework.dist import adopt_slurm_env, launched_as_worker, slurm_task
from framework.doors.job_clock import job_start
from framework.hooks import CallbackFailure
from framework.machine import launch_local
from framework.parallel.dims import Strategy
from framework.plan.baseline import ensure_measured
from framework.run.resilience import DUMP_FOLDER, Preempted, exit_code, flight_recorder_env, read_dumps
from framework.run.run_files import Summary, read_summary, write_summary

log = logging.getLogger(__name__)

GROUPS = ("backend", "parallel", "precision", "memory", "peft", "data", "model", "optim", "schedule", "logger")
# a worker's errors that say it all in their message: no traceback
ONE_LINE = (CheckpointError, DataError, CallbackFailure)

_SHELL_ENV: dict[str, str | None] = {}  # what the environment held before we exported a knob


def export_backend_env(env: dict[str, str]) -> None:
    """Set this job's knobs, first restoring those an earlier job of the same sweep set: a knob
    unset in this job's config stays unset (or as the shell had it)."""
    for key, value in _SHELL_ENV.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    _SHELL_ENV.clear()
    for key, value in env.items():
        _SHELL_ENV[key] = os.environ.get(key)
        os.environ[key] = value


class RunFailed(RuntimeError):
    """A worker failed; its error has been printed and the summary says "failed"."""


def main(cfg: DictConfig) -> float | None:
    """Hydra task function. Returns the figure a sweeper optimises (`optimize`: tokens/s by
    default), NaN for a failed run (a search scores it as a failed trial), None on ranks > 0."""
    if slurm_task():
        adopt_slurm_env(cfg.launch.master_port)  # srun started this process as one rank
    hydra_cfg = HydraConfig.get()
    run_dir, sweeping = hydra_cfg.runtime.output_dir, hydra_cfg.mode == RunMode.MULTIRUN
    # a group's choice: its `name`, else what Hydra picked (a user's own model/<name>.yaml may have none)
    choices = {g: cfg[g].get("name") or hydra_cfg.runtime.choices.get(g) for g in GROUPS}
    # the callbacks group's node is its entries by the user's names (no `name`): Hydra's pick
    choices |= {g: hydra_cfg.runtime.choices.get(g) for g in ("callbacks", "experiment")}
    if sweeping and cfg.sweep.skip_done and (done := finished_summary(run_dir)) is not None:
        print(f"skip: {run_dir} already finished (sweep.skip_done=true)", flush=True)
        return objective(done.to_dict(), cfg.optimize)
    started = job_start(cfg, hydra_cfg)
    try:
        lock = hold_run_folder(run_dir)  # first: one writer per run folder (framework/checkpoint/runlock.py)
        plan_auto = admit(cfg, run_dir, choices)
    except (ConfigError, FolderInUse) as err:  # a refused run writes nothing into the other run's folder
        print(f"error: {err}", file=sys.stderr)
        if not sweeping:  # the folder a refused config made goes; another run's (FolderInUse) stays
            discard_refused(run_dir, lock if isinstance(err, ConfigError) else None)
            sys.exit(2)
        if isinstance(err, ConfigError):  # one bad job of a sweep: recorded as failed, the others still run
            lock.release()
            write_summary(run_dir, Summary.failed(f"ConfigError: {err}", choices))
        return failed_job(hydra_cfg, err)
    config, job = worker_config(cfg, hydra_cfg, sweeping), Job(run_dir, choices, started, plan_auto)
    # NCCL/Gloo knobs go into the environment before any process group exists; local workers
    # inherit them (and NCCL's watchdog dump settings). The run's config dump and W&B record them.
    recorder = flight_recorder_env(resolve_backend(cfg), cfg.backend.trace_buffer, run_dir)
    export_backend_env(backend_env(cfg.backend) | recorder)
    try:
        summary = start(config, job)
    except Preempted as stop:  # saved; a sweep stops here too (rerun it with sweep.skip_done=true)
        if int(os.environ.get("RANK", 0)) == 0:
            print(resume_hint(stop, run_dir, sweeping, hydra_cfg.overrides.task), file=sys.stderr, flush=True)
        sys.exit(exit_code(stop.signum))
    except RunFailed as err:
        if not sweeping:
            sys.exit(1)
        return failed_job(hydra_cfg, err)  # the worker's error is printed and in its summary
    except Exception as err:
        if not sweeping:
            raise
        print(f"error: {type(err).__name__}: {err}", file=sys.stderr)  # parallel=none runs in-process
        return failed_job(hydra_cfg, err)
    finally:
        lock.release()
    return None if summary is None else objective(summary, cfg.optimize)


def admit(cfg: DictConfig, run_dir: str, choices: dict[str, str]) -> dict[str, Any] | None:
    """Everything a run is checked for before any worker starts (the planner first, under
    parallel=auto: its layout and knobs go into `cfg`, what the workers run, and the record of
    why is returned, to travel beside it); a ConfigError names the key."""
    auto = None
    if cfg.parallel.name == "auto":  # ranks a launcher started decide from the config alone: all pick alike
        from framework.plan import plan_auto

        choice = plan_auto(cfg, world_size_of(cfg), "config" if launched_as_worker() else "probe")
        choice.apply(cfg)
        choices["parallel"], auto = cfg.parallel.name, choice.record
        if int(os.environ.get("RANK", 0)) == 0:
            print(choice.line(), flush=True)
    validate(cfg)  # plan.gpu too: the planner's closing forecast would only warn of it, after the run
    check_best_exists(cfg, run_dir)
    if launched_as_worker() and Strategy.of(cfg.parallel).one_process and int(os.environ["WORLD_SIZE"]) != 1:
        raise ConfigError(
            "parallel",
            f"parallel=none runs one process; the launcher started WORLD_SIZE={os.environ['WORLD_SIZE']}. Choose parallel=ddp",
        )
    return auto


def worker_config(cfg: DictConfig, hydra_cfg: Any, sweeping: bool) -> DictConfig:
    """The config every rank runs with, in the one form it keeps from here on: resolved (the
    workers have no Hydra context to resolve `${hydra:...}` in) and in struct mode (a misspelt key
    read anywhere below is an error, not None)."""
    config = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    if sweeping:
        # one sweep's W&B runs share a group (the sweep directory's name), each named by its own overrides
        config.logger.group = config.logger.get("group") or os.path.basename(hydra_cfg.sweep.dir.rstrip("/"))
        config.logger.run_name = hydra_cfg.job.override_dirname or None
    OmegaConf.set_struct(config, True)
    return config


@dataclass(frozen=True)
class Job:
    """What every rank of a job is told besides its config."""

    run_dir: str
    choices: dict[str, str]  # the chosen name of each group, for the summary and W&B
    started: float  # when this job started (job_start), for summary.startup_s
    plan_auto: dict[str, Any] | None = None  # parallel=auto: the planner's choice and why (summary.plan.auto)


def start(config: DictConfig, job: Job) -> dict[str, Any] | None:
    """Train here (already a worker, or parallel=none) or start the local workers."""
    if launched_as_worker() or Strategy.of(config.parallel).one_process:
        return train_here(config, job)
    return launch_local_workers(config, job, resolve_nproc(config))


def job_id() -> str:
    """What the processes of one job share (one job is one writer of its run folder): the SLURM
    job step or torchrun run of a job an outside launcher started, else this process."""
    env = os.environ
    if launched_as_worker() and "SLURM_JOB_ID" in env and "TORCHELASTIC_RUN_ID" not in env:
        return f"slurm-{env['SLURM_JOB_ID']}-{env.get('SLURM_STEP_ID', env.get('SLURM_STEPID', '0'))}"
    if launched_as_worker() and env.get("TORCHELASTIC_RUN_ID", "none") != "none":
        return f"torchrun-{env['TORCHELASTIC_RUN_ID']}"  # the same through torchrun's restarts
    if launched_as_worker():
        return f"torchrun-{env.get('MASTER_ADDR')}-{env.get('MASTER_PORT')}"
    return f"local-{os.getpid()}"


def hold_run_folder(run_dir: str) -> RunLock:
    """Take the run folder's lock (this process starts the workers, or is rank 0 of an outside
    launcher's job), or, as another rank of such a job, check that the job holds it."""
    lock = RunLock(run_dir, job_id())
    if int(os.environ.get("RANK", 0)) > 0:
        lock.share()
    else:
        line = lock.acquire()
        if line:
            print(line, file=sys.stderr, flush=True)
    return lock


def resume_hint(stop: Preempted, run_dir: str, sweeping: bool, overrides: list[str]) -> str:
    """The one line a preempted run prints: where it stopped and how to continue."""
    where = f"preempted by {signal.Signals(stop.signum).name} after step {stop.step}; checkpoint: {stop.path}"
    if sweeping:
        return f"{where}. Resume: rerun the sweep with the same hydra.sweep.dir, sweep.skip_done=true checkpoint.resume=auto"
    kept = [o for o in overrides if not o.startswith(("checkpoint.resume=", "hydra.run.dir="))]
    args = [*kept, f"hydra.run.dir={run_dir}", "checkpoint.resume=auto"]
    return f"{where}. Resume: python train.py {' '.join(shlex.quote(a) for a in args)}"


def failed_job(hydra_cfg: Any, err: Exception) -> float:
    """What a failed sweep job returns. Hydra's basic sweeper stops the whole sweep when a job
    raises, so there the job returns NaN and the others run on; a search (Optuna) records a job
    that raises as a failed trial (up to the sweeper's `max_failure_rate`), so there it raises."""
    if "BasicSweeper" in str(hydra_cfg.sweeper.get("_target_", "")):
        return math.nan
    raise RunFailed(str(err)) from None


def objective(summary: dict[str, Any], optimize: str) -> float:
    """The figure a sweeper optimises, from a run's summary; NaN for a failed run or a figure
    the run does not have (tokens/s of an image model)."""
    if summary.get("status") != "ok":
        return math.nan
    if optimize == "val_loss":  # the last evaluation's (summary.eval.loss)
        value = (summary.get("eval") or {}).get("loss")
    else:
        value = summary["final_loss"] if optimize == "final_loss" else summary["throughput"].get(optimize)
    return math.nan if value is None else float(value)


def check_best_exists(cfg: DictConfig, run_dir: str) -> None:
    """checkpoint.resume=best needs a best checkpoint of this run (checkpoint.monitor saves one); a checkpoint
    resumed by name (best, a folder) needs steps after it (none was a worker's traceback, over the run's summary)."""
    from framework.checkpoint.store import best_root, complete, latest, read_trainer_state
    from framework.run.run_files import checkpoint_root

    resume, where = cfg.checkpoint.resume, best_root(checkpoint_root(cfg, run_dir))
    if resume == "best" and (resume := latest(where)) is None:
        raise ConfigError(
            "checkpoint.resume", f"best: no best checkpoint under {where} (checkpoint.monitor=val_loss saves one)"
        )
    try:  # a checkpoint whose state does not read is checkpoint.verify's to name, in the workers
        step = read_trainer_state(resume).step if resume not in (None, "auto") and complete(resume) else None
    except (OSError, ValueError, TypeError):
        step = None
    if step is not None and step >= cfg.steps:
        raise ConfigError("checkpoint.resume", f"{cfg.checkpoint.resume}: {resume} is at step {step} and "
                          f"steps={cfg.steps}: nothing left to train (set steps above {step})")  # fmt: skip


def finished_summary(run_dir: str) -> Summary | None:
    """The summary of a run that already finished ok in `run_dir`, else None."""
    summary = read_summary(run_dir)
    return summary if summary is not None and summary.status == "ok" else None


def launch_local_workers(config: DictConfig, job: Job, nproc: int) -> dict[str, Any] | None:
    """Start `nproc` workers on this machine with torch's elastic agent and wait for them."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch  # noqa: F401 (its agent's loggers exist now)

    for name in list(logging.Logger.manager.loggerDict):  # each elastic module's logger sets its own level
        if name.startswith(("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing")):
            logging.getLogger(name).setLevel(logging.CRITICAL)  # failures are reported below, once
    ensure_measured(config, nproc)  # the planner's figure for the workers' baseline, once per machine
    knobs = {k: config.launch[k] for k in ("max_restarts", "monitor_interval_s", "start_method")}
    run_dir = job.run_dir
    try:
        results = launch_local(nproc, spawned_worker, config, job, **knobs)
    except SignalException as err:  # this process got the signal; the agent passed it to the workers
        raise preempted(run_dir, err.sigval) from None
    except ChildFailedError as err:
        codes = {failure.exitcode for failure in err.failures.values()}
        if codes <= {exit_code(signal.SIGTERM), exit_code(signal.SIGINT)}:  # the workers were signalled
            raise preempted(run_dir, max(codes) - 128) from None
        errors = [f"worker rank {rank} failed (exit code {failure.exitcode}): {_failure_message(failure)}"
                  for rank, failure in sorted(err.failures.items())]  # fmt: skip
        recorded = read_summary(run_dir)
        cause = recorded.error if recorded else None  # the first failing rank's own error (others may exit first)
        if cause and cause.startswith(tuple(f"{kind.__name__}: " for kind in ONE_LINE)):  # one line says it all
            print(f"error: {cause.split(': ', 1)[1]}", file=sys.stderr)
            raise RunFailed(cause) from None
        for line in errors:
            print(f"error: {line}", file=sys.stderr)
        if hang := read_dumps(os.path.join(run_dir, DUMP_FOLDER)):  # NCCL's watchdog dumps on a timeout
            print(f"error: {hang}", file=sys.stderr)
        if cause and not any(cause in line for line in errors):
            print(f"error: {cause}", file=sys.stderr)
        print(f"error: run failed; its files are in {run_dir}", file=sys.stderr)
        raise RunFailed(cause or errors[0]) from None
    return results.get(0)


def preempted(run_dir: str, signum: int) -> Preempted:
    """The preemption the workers recorded (with its checkpoint), else an exit with the signal's code."""
    summary = read_summary(run_dir)
    if summary is None or summary.status != "preempted":
        print(f"error: stopped by {signal.Signals(signum).name} before a checkpoint was saved", file=sys.stderr)
        sys.exit(exit_code(signum))
    return Preempted(signal.Signals[summary.signal], summary.step, summary.checkpoint)


def _failure_message(failure: Any) -> str:
    data = failure.error_file_data
    if isinstance(data, dict) and isinstance(data.get("message"), dict):
        return data["message"].get("message", "").strip() or failure.message
    return str(failure.message or "no error file; see the worker's output above")


def train_here(config: DictConfig, job: Job) -> dict[str, Any] | None:
    """Train in this process (parallel=none; one rank of torchrun or srun). A checkpoint that
    does not verify, or a failed save, is one line (rank 0's; every rank has the same)."""
    try:
        return worker_main(config, job)
    except ONE_LINE as err:
        if int(os.environ.get("RANK", 0)) == 0:
            print(f"error: {err}", file=sys.stderr)
        raise RunFailed(str(err)) from None


def spawned_worker(config: DictConfig, job: Job) -> dict[str, Any] | None:
    """The entrypoint of a worker the local launcher starts: a preempted worker exits with the
    signal's code (no traceback); the launcher reads the rest from summary.json."""
    try:
        return worker_main(config, job)
    except Preempted as stop:
        sys.exit(exit_code(stop.signum))
    except ONE_LINE:
        sys.exit(1)  # the launcher prints its one line


def worker_main(config: DictConfig, job: Job) -> dict[str, Any] | None:
    """One rank's whole life (module level, so the elastic launcher can start it by reference);
    record() writes its exception to the error file the launcher reads back."""
    from torch.distributed.elastic.multiprocessing.errors import record

    from framework.run.trainer import run

    return record(run)(config, job.run_dir, job.choices, job.started, job.plan_auto)
