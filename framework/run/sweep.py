"""Train several configs back to back in one group of local worker processes.

Benchmarks and tests compare strategies side by side; starting a process group per config would
cost more than the short runs themselves. Here the workers start once, then each config builds
its own mesh and model on the shared world, trains and summarises. Configs are resolved dicts
(compose and validate them first).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from omegaconf import OmegaConf


def run_configs(configs: dict[str, dict[str, Any]], world_size: int, out_dir: str) -> dict[str, dict[str, Any]]:
    """{name: summary} for every config, each run in `out_dir/name` on `world_size` workers."""
    from framework.machine import launch_local

    place = device_and_backend(configs)
    return launch_local(world_size, _train_each, configs, out_dir, place)[0]


def device_and_backend(configs: dict[str, dict[str, Any]]) -> tuple[str, str]:
    """The device and process-group backend of the configs, as train.py resolves them (on a GPU
    machine, device=auto is CUDA and NCCL): one group of workers runs configs that agree on both."""
    from framework.config import resolve_backend, resolve_device

    each = {name: (resolve_device(c), resolve_backend(c)) for name, c in
            ((name, OmegaConf.create(config)) for name, config in configs.items())}  # fmt: skip
    if len(set(each.values())) > 1:
        raise ValueError(f"run_configs: one group of workers runs configs of one device and backend; got {each}")
    return next(iter(each.values()))


def _train_each(configs: dict[str, dict[str, Any]], out_dir: str, place: tuple[str, str]) -> dict[str, dict[str, Any]]:
    from framework.dist import destroy_distributed, init_distributed
    from framework.run.resilience import Guard
    from framework.run.run_files import RunFiles
    from framework.run.trainer import train

    info = init_distributed(*place, timeout_s=300)
    summaries = {}
    try:
        for name, config in configs.items():
            cfg = OmegaConf.create(config)
            torch.manual_seed(cfg.seed)
            with Guard(info, cfg.checkpoint.preempt_grace_s) as guard:
                files = RunFiles(os.path.join(out_dir, name), info)
                summaries[name] = train(cfg, info, files, {"parallel": cfg.parallel.name}, guard)
    finally:
        destroy_distributed()
    return summaries
