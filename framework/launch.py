"""Start the run: validate, then either train here (already a worker) or start local workers.

Three ways a process reaches ``main``:
- ``python train.py`` on a workstation: start ``launch.nproc_per_node`` workers with torch's
  elastic launcher (the engine behind torchrun) on a free port, wait, report;
- ``torchrun ... train.py`` / SLURM: the launcher already set RANK and WORLD_SIZE, so this process
  is one worker: train directly;
- ``parallel=none``: one process, no process group: train in this process.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import uuid
from datetime import datetime
from typing import Any

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from framework.config import ConfigError, backend_env, resolve_nproc, validate

log = logging.getLogger(__name__)

GROUPS = ("backend", "parallel", "precision", "memory", "data", "model", "optim", "logger")


def launched_as_worker() -> bool:
    """True when an outside launcher (torchrun, srun, ...) started this process as one rank."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


@functools.cache
def _run_id() -> str:
    # One run directory per run, never one per rank: every rank of a torchrun job resolves the
    # same name (the rendezvous id, else the master port); a local run uses the time.
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    if launched_as_worker() and run_id != "none":
        return f"torchrun-{run_id}"
    if launched_as_worker() and "MASTER_PORT" in os.environ:
        return f"torchrun-{os.environ.get('MASTER_ADDR', 'localhost')}-{os.environ['MASTER_PORT']}"
    return datetime.now().strftime("%H-%M-%S-%f")


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


def register_resolvers() -> None:
    OmegaConf.register_new_resolver("run_id", _run_id, replace=True)


def main(cfg: DictConfig) -> dict[str, Any] | None:
    """Hydra task function: returns rank 0's summary (so sweeps and tests can read it)."""
    try:
        validate(cfg)
        if launched_as_worker() and cfg.parallel.name == "none" and int(os.environ["WORLD_SIZE"]) != 1:
            raise ConfigError(
                "parallel",
                f"parallel=none runs one process; the launcher started WORLD_SIZE={os.environ['WORLD_SIZE']}. Choose parallel=ddp",
            )
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)

    hydra_cfg = HydraConfig.get()
    run_dir = hydra_cfg.runtime.output_dir
    config = OmegaConf.to_container(cfg, resolve=True)
    choices = {g: cfg[g].name for g in GROUPS}
    choices["experiment"] = hydra_cfg.runtime.choices.get("experiment")

    # NCCL/Gloo knobs go into the environment before any process group exists; local workers
    # inherit them. They are part of the config, so the run's config dump and W&B record them.
    export_backend_env(backend_env(cfg.backend))
    if launched_as_worker() or cfg.parallel.name == "none":
        return worker_main(config, run_dir, choices)
    return launch_local_workers(config, run_dir, choices, resolve_nproc(cfg))


def local_launch_config(
    nproc: int, max_restarts: int = 0, monitor_interval_s: float = 0.1, start_method: str = "spawn"
):
    """torch's elastic launcher set up for `nproc` workers on this machine (as `torchrun
    --standalone` does), used by train.py, the config sweeps of benchmarks and the tests."""
    from torch.distributed.launcher.api import LaunchConfig

    return LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"hydradist-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",  # port 0: a free port, so concurrent runs never collide
        max_restarts=max_restarts,
        monitor_interval=monitor_interval_s,
        start_method=start_method,
    )


def launch_local_workers(
    config: dict[str, Any], run_dir: str, choices: dict[str, str], nproc: int
) -> dict[str, Any] | None:
    """Start `nproc` workers on this machine with torch's elastic agent and wait for them."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    for name in ("torch.distributed.elastic", "torch.distributed.launcher"):
        logging.getLogger(name).setLevel(logging.WARNING)
    launch = config["launch"]
    launch_config = local_launch_config(
        nproc, launch["max_restarts"], launch["monitor_interval_s"], launch["start_method"]
    )
    try:
        results = elastic_launch(launch_config, worker_main)(config, run_dir, choices)
    except ChildFailedError as err:
        for rank, failure in sorted(err.failures.items()):
            print(
                f"error: worker rank {rank} failed (exit code {failure.exitcode}): {_failure_message(failure)}",
                file=sys.stderr,
            )
        print(f"error: run failed; its files are in {run_dir}", file=sys.stderr)
        sys.exit(1)
    return results.get(0)


def _failure_message(failure: Any) -> str:
    data = failure.error_file_data
    if isinstance(data, dict) and isinstance(data.get("message"), dict):
        return data["message"].get("message", "").strip() or failure.message
    return str(failure.message or "no error file; see the worker's output above")


def worker_main(config: dict[str, Any], run_dir: str, choices: dict[str, str]) -> dict[str, Any] | None:
    """One rank's whole life (module level, so the elastic launcher can start it by reference)."""
    from torch.distributed.elastic.multiprocessing.errors import record

    from framework.trainer import run

    # record() writes this rank's exception to the error file the launcher reads back.
    cfg = OmegaConf.create(config)
    OmegaConf.set_struct(cfg, True)  # a misspelt key read anywhere below is an error, not None
    return record(run)(cfg, run_dir, choices)
