"""The run id resolver (`${run_id:}` in hydra.run.dir): one name per run, the same on every rank."""

from __future__ import annotations

import functools
import os
from datetime import datetime

from omegaconf import OmegaConf

from framework.machine import launched_as_worker, slurm_task


@functools.cache
def _run_id() -> str:
    # One run directory per run, never one per rank: every rank of a job resolves the same name
    # from what its launcher shares (the SLURM job and step, the rendezvous id, else the master
    # port), never from the clock, which may differ between nodes. A local run uses the time.
    env = os.environ
    if slurm_task():
        return f"jobs/slurm-{env['SLURM_JOB_ID']}-{env.get('SLURM_STEP_ID', env.get('SLURM_STEPID', '0'))}"
    run_id = env.get("TORCHELASTIC_RUN_ID", "none")
    if launched_as_worker() and run_id != "none":
        return f"jobs/torchrun-{run_id}"
    if launched_as_worker() and "MASTER_PORT" in env:
        return f"jobs/torchrun-{env.get('MASTER_ADDR', 'localhost')}-{env['MASTER_PORT']}"
    return datetime.now().strftime("%Y-%m-%d/%H-%M-%S-%f")


def register_run_id() -> None:
    """`${run_id:}` (framework.config.register_resolvers registers it with the data's `${data_vocab:}`)."""
    OmegaConf.register_new_resolver("run_id", _run_id, replace=True)
