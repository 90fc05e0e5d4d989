"""The process baseline of the peak-memory model: a worker's resident bytes before its model.

On CPU it is measured once per machine and cached with the other figures (framework.plan.profile):
a fresh interpreter that imports what a worker imports (a run in this process, parallel=none),
or a worker forked from the forkserver that did (framework.preload), which holds only the pages
of torch it touches. The first run on a machine also records its own reading where no probe has.
"""

from __future__ import annotations

import os

import torch
from omegaconf import DictConfig

from framework.machine import cpu_name, launch_local
from framework.plan.cache import read_cache, write_cache

# the process before the model: imports and the backend (CPU: torch and the framework resident;
# CUDA: the allocator counts from zero), and what the allocator keeps beyond the live bytes
NOMINAL_BASELINE = {"cpu": 700 * 2**20, "cuda": 0}


def forks_workers(cfg: DictConfig, world: int) -> bool:
    """Whether the run's ranks are workers forked from the forkserver (not this process itself)."""
    from framework.parallel.dims import Strategy

    one = world == 1 and cfg.parallel.name != "auto" and Strategy.of(cfg.parallel).one_process
    return not one and cfg.launch.get("start_method", "forkserver") in ("forkserver", "fork")


def baseline_bytes(device: str, measure: str, forked: bool = False) -> tuple[int, str]:
    """(the resident bytes of a worker before its model, where the figure came from): on CPU a
    fresh interpreter importing what a worker imports, or (`forked`: a worker the forkserver
    starts, launch.start_method=forkserver) a worker forked from one that did, which holds only
    the pages of torch it touches. Measured once and cached."""
    if device == "cuda" or measure == "config":
        return NOMINAL_BASELINE[device], "nominal"
    key = _baseline_key(device, forked)
    cached = read_cache().get(key)
    if cached is not None:
        return cached["bytes"], "cache"
    if measure != "probe":
        return NOMINAL_BASELINE[device], "nominal"
    value = launch_local(1, _worker_rss)[0] if forked else _process_rss()
    if value is None:
        return NOMINAL_BASELINE[device], "nominal"
    write_cache(key, {"bytes": value})
    return value, "probe"


def _baseline_key(device: str, forked: bool) -> str:
    return f"baseline|{cpu_name()}|{device}|torch={torch.__version__}|{'forked' if forked else 'process'}"


def remember_baseline(cfg: DictConfig, world: int, measured: int | None) -> None:
    """A run's own reading of its workers' baseline, cached where none is yet: the first run on a
    machine measures it for every later one (and for its own check)."""
    from framework.config import resolve_device

    device = resolve_device(cfg)
    if device == "cuda" or not measured:
        return
    key = _baseline_key(device, forks_workers(cfg, world))
    if key not in read_cache():
        write_cache(key, {"bytes": int(measured)})


def _worker_rss() -> int:
    """A forked worker's resident bytes (the forkserver imported the trainer: framework.preload)."""
    import framework.memory as m

    return m.current_rss_bytes()


def _process_rss() -> int | None:
    import subprocess
    import sys

    code = (
        "import torch, torch._dynamo, torch.distributed, framework.trainer, framework.memory as m; "
        "print(m.current_rss_bytes())"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    return None if out.returncode else int(out.stdout.split()[-1])
