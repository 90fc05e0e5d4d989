"""This machine, as the layers above see it: its name, how many ranks it runs at once, and the
launcher that starts local workers. The bottom layer (no framework imports): launch, the planner's
probes, the sweeps and the tests all start workers through it."""

from __future__ import annotations

import os
import platform
import uuid


def cpu_name() -> str:
    """The CPU model (what a cache of measured figures is keyed by)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "cpu"


def device_slots(device: str) -> int:
    """Ranks this machine can host at once: its GPUs on CUDA, else its cores."""
    if device == "cuda":
        import torch

        return max(1, torch.cuda.device_count())
    return os.cpu_count() or 1


def local_ranks(world: int, nodes: int, nproc_per_node: int | None, device: str) -> int:
    """The ranks one node of a `world`-rank job on `nodes` nodes runs here: the most worker
    processes a probe on this machine may start. `launch.nproc_per_node`, where set, is what this
    machine will run (a laptop may oversubscribe its cores on purpose); else world / nodes, capped
    by this machine's cores or GPUs."""
    if nproc_per_node:
        return max(1, min(world, nproc_per_node))
    return max(1, min(world, -(-world // max(1, nodes)), device_slots(device)))


def local_launch_config(
    nproc: int, max_restarts: int = 0, monitor_interval_s: float = 0.1, start_method: str = "spawn"
):
    """torch's elastic launcher set up for `nproc` workers on this machine (as `torchrun
    --standalone` does), used by train.py, the planner's link probe, the config sweeps of
    benchmarks and the tests."""
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
