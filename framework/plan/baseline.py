"""The process baseline of the peak-memory model: a worker's resident bytes before its model.

On CPU it is measured once per machine and cached with the other figures (framework.plan.profile):
a fresh interpreter that imports what a worker imports (a run in this process, parallel=none),
or a worker forked from the forkserver that did (framework.doors.preload), which holds only the pages
of torch it touches. A local launch measures it before its workers start, where no cache holds it yet.
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
    starts, launch.start_method=forkserver) a worker forked from one that did, after a tiny step
    (it holds only the pages of torch it has touched). Measured once and cached; a local launch
    measures it before its workers start (`ensure_measured`)."""
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


def ensure_measured(cfg: DictConfig, world: int) -> None:
    """Measure this machine's baseline for the run's workers if no cache holds it (once per machine,
    a second or two): so the run's own check of the planner (rank 0, from the cache) has it."""
    from framework.config import resolve_device

    device = resolve_device(cfg)
    if device != "cuda" and cfg.plan.get("profile", "probe") != "config":  # config: the nominal figure
        baseline_bytes(device, "probe", forks_workers(cfg, world))


def _baseline_key(device: str, forked: bool) -> str:
    return f"baseline|{cpu_name()}|{device}|torch={torch.__version__}|{'forked' if forked else 'process'}"


def _worker_rss() -> int:
    """A forked worker's resident bytes once it has run a step: a tiny block's forward, backward
    and AdamW update touch the pages of torch's kernels, autograd and the optimizer that any run
    touches (the forkserver imported them, framework.doors.preload; a worker maps them as it uses them)."""
    import framework.measure.memory as m

    block = torch.nn.Sequential(
        torch.nn.LayerNorm(64), torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)
    )
    optimizer = torch.optim.AdamW(block.parameters())
    for _ in range(2):
        x = torch.randn(4, 16, 64)
        q = x.view(4, 16, 4, 16).transpose(1, 2)
        attention = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        loss = torch.nn.functional.cross_entropy(
            block(x + attention.transpose(1, 2).reshape(4, 16, 64)).flatten(0, 1), torch.zeros(64, dtype=torch.long)
        )
        loss.backward()
        torch.nn.utils.clip_grad_norm_(block.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
    del block, optimizer
    return m.current_rss_bytes()


def _process_rss() -> int | None:
    import subprocess
    import sys

    code = (
        "import torch, torch._dynamo, torch.distributed, framework.run.trainer, framework.measure.memory as m; "
        "print(m.current_rss_bytes())"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    return None if out.returncode else int(out.stdout.split()[-1])
