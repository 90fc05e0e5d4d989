"""Process group set-up and rank helpers.

Glossary: a *rank* is one worker process; the *world* is all of them; a mesh *axis* (later
issues) names a group of ranks, not a tensor dim.
"""

from __future__ import annotations

import gc
import os
import re
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from framework.machine import (  # noqa: F401  (re-exported: launch and the sweeps start workers through it)
    launched_as_worker,
    local_launch_config,
    slurm_task,
    usable_cores,
)


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str | None  # None: single process, no process group

    @property
    def is_main(self) -> bool:
        """Rank 0 does the rank-0-only work: files, progress bar, W&B."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.backend is not None


def restart_count() -> int:
    """How often torch's elastic agent has restarted the workers (0: first attempt)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: "gpu[007-009,012],cpu1" -> "gpu007"."""
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if match is None:
        raise ValueError(f"cannot read the SLURM node list {nodelist!r}")
    prefix, ranges = match.groups()
    return prefix + ranges.split(",")[0].split("-")[0] if ranges else prefix


def adopt_slurm_env(master_port: int | None = None) -> None:
    """Under srun (see `slurm_task`) this process is rank SLURM_PROCID of SLURM_NTASKS: export
    the variables torch.distributed reads. MASTER_ADDR: the job's first host unless set;
    MASTER_PORT: `master_port`, else derived from the job id (every task derives the same)."""
    env = os.environ
    nodelist = env.get("SLURM_JOB_NODELIST") or env["SLURM_NODELIST"]
    per_node = env.get("SLURM_NTASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE", "1")
    env["RANK"] = env["SLURM_PROCID"]
    env["WORLD_SIZE"] = env["SLURM_NTASKS"]
    env["LOCAL_RANK"] = env["SLURM_LOCALID"]
    env["LOCAL_WORLD_SIZE"] = re.match(r"\d+", per_node).group(0)  # "4(x2)": 4 tasks on each of 2 nodes
    env.setdefault("MASTER_ADDR", first_host(nodelist))
    env.setdefault("MASTER_PORT", str(master_port or 20000 + int(env["SLURM_JOB_ID"]) % 20000))


def cuda_device_index(local_rank: int, local_world_size: int, visible: int, bound: bool = False) -> int:
    """The CUDA ordinal local rank `local_rank` of `local_world_size` trains on, among the `visible`
    devices it sees. torchrun (or srun with the node's GPUs visible to every task): one device per
    local rank, the local rank's own; more local ranks than devices would put two ranks on one GPU
    (each holding a copy of the model and fighting for its memory), and is refused. Under SLURM's
    per-task binding (`bound`: `--gpus-per-task`, `--gpu-bind`) each task sees only its own
    device(s), renumbered from 0: it trains on its first."""
    if visible < 1:
        raise RuntimeError("device=cuda but this process sees no CUDA device (check CUDA_VISIBLE_DEVICES)")
    if bound:
        return 0
    if local_world_size > visible:
        raise RuntimeError(
            f"launch: {local_world_size} ranks on this node but {visible} CUDA device(s) visible: two ranks "
            f"would share one GPU; start at most {visible} (launch.nproc_per_node, torchrun --nproc-per-node)"
        )
    return local_rank


def slurm_binds_gpus(env=os.environ) -> bool:
    """Whether SLURM bound each task to its own GPUs (it then sets these for the task)."""
    return "SLURM_GPUS_PER_TASK" in env or "SLURM_GPU_BIND" in env


def init_distributed(device_kind: str, backend: str | None, timeout_s: int, init_method: str = "env") -> DistInfo:
    """Join the process group the launcher set up (RANK/WORLD_SIZE/MASTER_* in the environment).

    ``backend=None`` means a single process without a process group (parallel=none).
    """
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1))

    if device_kind == "cuda":
        index = cuda_device_index(local_rank, local_world_size, torch.cuda.device_count(), slurm_binds_gpus())
        device = torch.device("cuda", index)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        # Local workers share the cores: without this each one would start a thread per core.
        torch.set_num_threads(max(1, usable_cores() // local_world_size))

    if backend is not None:
        timeout = timedelta(seconds=timeout_s)
        group = {"rank": rank, "world_size": world_size, "timeout": timeout, **bound_device(device, backend)}
        if init_method == "env" and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            # Under torch's elastic agent, build the group on the agent's store with a prefix per
            # restart: after a worker dies, restarted gloo workers would otherwise read their dead
            # peers' addresses from the store and fail to connect.
            store = dist.TCPStore(
                os.environ["MASTER_ADDR"],
                int(os.environ["MASTER_PORT"]),
                is_master=False,
                timeout=timeout,
            )
            prefix = f"hydradist/restart{restart_count()}"
            dist.init_process_group(backend, store=dist.PrefixStore(prefix, store), **group)
        else:
            dist.init_process_group(backend, init_method="env://" if init_method == "env" else init_method, **group)
    return DistInfo(rank, world_size, local_rank, local_world_size, device, backend)


def bound_device(device: torch.device, backend: str) -> dict:
    """`device_id` for init_process_group under NCCL: the group's communicator is bound to this
    rank's GPU at once (no guess from the current device, no lazy set-up at the first collective)."""
    return {"device_id": device} if device.type == "cuda" and "nccl" in backend else {}


def destroy_distributed() -> None:
    """Leave the process group, and free what still holds one while the interpreter is whole.

    A wrapper such as DDP or FSDP sits in a reference cycle (its hooks refer back to it), so
    without a collection here it outlives the run and its process group (and Gloo's threads) is
    torn down during interpreter shutdown, where a thread that needs the GIL is killed with
    SIGABRT ("terminate called without an active exception"): a worker that trained correctly
    then dies at exit under torchrun, now and then, under load."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()


def all_reduce_sum(tensor: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """Sum of `tensor` over all ranks (a copy; the input is left alone)."""
    out = tensor.detach().clone()
    if info.distributed:
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out


def host_values(values: list[float], device: torch.device) -> torch.Tensor:
    """Python numbers as a float32 tensor on `device`, without a host sync: a plain `tensor(...,
    device=cuda)` copies from pageable memory and waits for the GPU; from pinned memory the copy
    is queued on the stream like any kernel."""
    t = torch.tensor(values, dtype=torch.float32)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


def all_gather_object(obj, info: DistInfo) -> list:
    if not info.distributed:
        return [obj]
    out = [None] * info.world_size
    dist.all_gather_object(out, obj)
    return out


@contextmanager
def one_process_checkpoint_io() -> Iterator[None]:
    """DCP's load in a process without a process group (evaluate, generate and export read a
    checkpoint in one process) warns on every call that it assumes one process. That is the
    intent there, so only that warning, only within the call, is not shown."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled, unavailable or uninitialized", UserWarning)
        yield
