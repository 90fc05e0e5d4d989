"""Where a job's clock starts, and a sweep's start-up that no job pays.

A job's figures count from its own start (summary.startup_s and launch_s, the goodput's wall
time: framework.callbacks.health.goodput). A plain run's start is its process's: its start-up is
its own. So is a job's that a launcher started a process for (submitit). The jobs that Hydra's
basic launcher runs one after another in the sweep's process each start where the sweep reaches
them: what the process did before its first job (Hydra, the imports) and the start of the workers'
forkserver (importing torch and the trainer: seconds, waited for here) are the sweep's start-up,
paid once, else charged to its first job alone. They go in the sweep's folder
(framework.run.run_files.write_sweep_startup), where the report reads them.
"""

from __future__ import annotations

import time
from typing import Any

from hydra.types import RunMode
from omegaconf import DictConfig

from framework.machine import launched_as_worker, process_start_time, slurm_task, warm_forkserver
from framework.run.run_files import write_sweep_startup

_jobs_started = 0
_sweep_startup: dict[str, float] = {}  # this process's sweep's start-up by part


def job_start(cfg: DictConfig, hydra_cfg: Any) -> float:
    """When the job started (time.time()), passed to its workers with the config; a sweep's job
    run in this process waits here for the workers' forkserver before its clock starts."""
    global _jobs_started
    _jobs_started += 1
    in_process = hydra_cfg.mode == RunMode.MULTIRUN and "BasicLauncher" in str(hydra_cfg.launcher.get("_target_"))
    if not in_process:
        return process_start_time() if _jobs_started == 1 else time.time()
    parts = {"launcher_s": time.time() - process_start_time()} if _jobs_started == 1 else {}
    if forks_local_workers(cfg):
        parts["workers_s"] = warm_forkserver()  # none once warm
    if any(parts.values()):
        for part, seconds in parts.items():
            _sweep_startup[part] = _sweep_startup.get(part, 0.0) + seconds
        write_sweep_startup(hydra_cfg.sweep.dir, _sweep_startup)
    return time.time()


def forks_local_workers(cfg: DictConfig) -> bool:
    """Whether the job will start local workers from the forkserver (launch.start's rule; a config
    it then refuses has started the forkserver for the sweep's next job)."""
    local = not (launched_as_worker() or slurm_task()) and cfg.parallel.name != "none"
    return local and cfg.launch.start_method == "forkserver"
