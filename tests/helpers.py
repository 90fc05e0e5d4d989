"""Shared helpers: compose configs, run train.py as a user would, start gloo worker groups."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"


def compose_config(overrides: list[str] | None = None):
    from framework.config import register_configs
    from framework.launch import register_resolvers

    register_configs()
    register_resolvers()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return compose(config_name="config", overrides=overrides or [])


def train_cli(args: list[str], run_dir: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python train.py ARGS` in a subprocess, as a user runs it (W&B offline, no network)."""
    cmd = [sys.executable, str(ROOT / "train.py"), *args]
    if run_dir is not None:
        cmd.append(f"hydra.run.dir={run_dir}")
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env |= {"WANDB_MODE": "offline", "PYTHONUNBUFFERED": "1"}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def read_summary(run_dir: Path) -> dict[str, Any]:
    return json.loads((Path(run_dir) / "summary.json").read_text())


def losses(run_dir: Path) -> list[float]:
    return [m["loss"] for m in read_metrics(run_dir)]


def run_workers(fn, world_size: int, *args) -> dict[int, Any]:
    """Run module-level `fn(*args)` on `world_size` local processes joined in a gloo group
    (through torch's elastic launcher, as train.py does); returns each rank's result."""
    from torch.distributed.launcher.api import elastic_launch

    from framework.launch import local_launch_config

    return elastic_launch(local_launch_config(world_size), _worker)(fn, args)


def _worker(fn, args):
    import torch.distributed as dist

    from framework.dist import destroy_distributed, init_distributed

    init_distributed("cpu", "gloo", timeout_s=120)
    try:
        return fn(dist.get_rank(), dist.get_world_size(), *args)
    finally:
        destroy_distributed()
