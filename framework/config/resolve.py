"""What a config means on this machine: the device, the backend, how many local workers, the
environment a backend reads, the world size the run will have."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from omegaconf import DictConfig

_ASSUMED_CUDA: list[int] = []  # assume_cuda_devices: a device count that stands in for this machine's


def backend_env(cfg: DictConfig) -> dict[str, str]:
    """Environment variables the `backend` group sets (unset knobs stay unset)."""
    env = {f"NCCL_{k.upper()}": str(v) for k, v in cfg.nccl.items() if v is not None}
    if cfg.gloo_socket_ifname is not None:
        env["GLOO_SOCKET_IFNAME"] = cfg.gloo_socket_ifname
    if cfg.trace_buffer:  # the flight recorder (gloo and NCCL): names the collective a rank is stuck in
        env["TORCH_FR_BUFFER_SIZE"] = str(cfg.trace_buffer)
    return env


def cuda_device_count() -> int:
    """The CUDA devices this process sees (the ones CUDA_VISIBLE_DEVICES leaves), or the count
    `assume_cuda_devices` stands in: every device decision of the config reads it from here."""
    if _ASSUMED_CUDA:
        return _ASSUMED_CUDA[-1]
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@contextmanager
def assume_cuda_devices(count: int) -> Iterator[None]:
    """Resolve and validate configs as on a machine with `count` visible GPUs (tests: a CPU
    machine proves that the suite's configs compose there too; nothing is run on them)."""
    _ASSUMED_CUDA.append(count)
    try:
        yield
    finally:
        _ASSUMED_CUDA.pop()


def resolve_device(cfg: DictConfig) -> str:
    if cfg.device == "auto":
        return "cuda" if cuda_device_count() > 0 else "cpu"
    return cfg.device


def resolve_backend(cfg: DictConfig) -> str:
    """The process group's backend. NCCL with FSDP CPU offload also gets gloo for CPU tensors:
    offloaded gradients live on the CPU, and clipping's norm all-reduce runs on them."""
    backend = {"cpu": "gloo", "cuda": "nccl"}[resolve_device(cfg)] if cfg.backend.name == "auto" else cfg.backend.name
    return "cpu:gloo,cuda:nccl" if backend == "nccl" and cfg.memory.name == "offload" else backend


def resolve_nproc(cfg: DictConfig) -> int:
    """Local worker processes to start: explicit, else 1 for parallel=none or dp, else one per GPU (CPU: 2)."""
    if cfg.launch.nproc_per_node is not None:
        return cfg.launch.nproc_per_node
    if cfg.parallel.name in ("none", "dp"):  # dp: one process drives every GPU
        return 1
    if resolve_device(cfg) == "cuda":
        return cuda_device_count()
    return 2


def world_size_of(cfg: DictConfig) -> int:
    """The world the run will have: the launcher's (torchrun sets WORLD_SIZE) or ours."""
    from framework.dist import launched_as_worker

    if launched_as_worker():
        return int(os.environ["WORLD_SIZE"])
    return resolve_nproc(cfg)
