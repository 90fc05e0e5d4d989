"""A plain `python train.py OVERRIDES` composes its config once.

Hydra's own path (`@hydra.main`) composes a run's config twice: `get_mode`, to learn whether the
config asks for a sweep, then `Hydra.run`; train.py's one-line check of the overrides
(`check_overrides`) composed it a third time before either. A plain run (no `-m`, no Hydra flag)
needs one: `run_plain` composes with Hydra's own config loader, then sets the job up as
`Hydra.run` does (the run folder, `.hydra/`, logging, `HydraConfig`, Hydra's callbacks) and calls
the task. What it does not take keeps Hydra's path: a flag or `-m`, a config that asks for a sweep
(`hydra.mode: MULTIRUN`), and a config that does not compose (train.py then names the override in
one line, or leaves it to Hydra's report).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

CONFIG_NAME = "config"


def run_plain(argv: list[str], task: Callable[[Any], Any], app_file: str) -> bool:
    """Run `task` on the config `argv` composes, composed once; False where Hydra's own path must
    (flags, a sweep, a config that does not compose: nothing has run then)."""
    if any(arg.startswith("-") for arg in argv):
        return False
    from hydra._internal.hydra import Hydra
    from hydra._internal.utils import create_automatic_config_search_path, detect_task_name, run_and_report
    from hydra.types import RunMode

    hydra = Hydra.create_main_hydra2(
        task_name=detect_task_name(app_file, None),
        config_search_path=create_automatic_config_search_path(app_file, None, "conf"),
    )
    try:
        cfg = hydra.compose_config(CONFIG_NAME, list(argv), run_mode=RunMode.RUN, with_log_configuration=True)
    except Exception:  # noqa: BLE001 - train.py's check names the override, else Hydra reports it
        return False
    if cfg.hydra.mode == RunMode.MULTIRUN:
        return False
    cfg.hydra.mode = RunMode.RUN
    start_workers_early(cfg)
    run_and_report(lambda: _run_job(hydra, cfg, task))
    return True


def start_workers_early(cfg: Any) -> None:
    """A run that will start local workers (framework.doors.launch.start) starts their forkserver as soon
    as its config is composed: the workers' imports (torch, the trainer: seconds) then run beside
    this process's own (torch, the checks) instead of after them."""
    from framework.machine import launched_as_worker, slurm_task, start_forkserver

    local_workers = not (launched_as_worker() or slurm_task()) and cfg.parallel.name != "none"
    if local_workers and cfg.launch.start_method == "forkserver":
        start_forkserver()


def _run_job(hydra: Any, cfg: Any, task: Callable[[Any], Any]) -> Any:
    """What `Hydra.run` does once it has composed: the job's folder, files, logging and callbacks."""
    from hydra._internal.callbacks import Callbacks
    from hydra.core.utils import run_job
    from hydra.types import HydraContext

    callbacks = Callbacks(cfg)
    callbacks.on_run_start(config=cfg, config_name=CONFIG_NAME)
    context = HydraContext(config_loader=hydra.config_loader, callbacks=callbacks)
    ret = run_job(hydra_context=context, task_function=task, config=cfg, job_dir_key="hydra.run.dir",
                  job_subdir_key=None, configure_logging=True)  # fmt: skip
    callbacks.on_run_end(config=cfg, config_name=CONFIG_NAME, job_return=ret)
    return ret.return_value  # raises the task's exception, as Hydra.run does
