"""Disk space for checkpoints: what one takes, what is free, and a full disk named as one.

A save into a full disk fails deep inside DCP or torch.save, often with no ENOSPC in sight
(`RuntimeError: [enforce fail at inline_container.cc] ... unexpected pos`), and its partial folder
holds the space the next attempt needs. So a save first checks that a checkpoint fits (the last
complete one's size, or before the first one the model and optimizer state's bytes), and a failed
one is called a full disk when its error says so or when the free space left could not hold the
rest of it.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Iterable
from typing import Any

import torch

FULL = (errno.ENOSPC, errno.EDQUOT)


def state_bytes(state: Any) -> int:
    """The bytes of every tensor in a nested state dict, sharded ones (DTensor, ShardedTensor) at
    their global size: about what DCP writes of it (replicated tensors are written once)."""
    if isinstance(state, dict):
        return sum(state_bytes(v) for v in state.values())
    if isinstance(state, list | tuple):
        return sum(state_bytes(v) for v in state)
    if isinstance(state, torch.Tensor) or hasattr(state, "local_shards"):  # ShardedTensor is not a Tensor
        return state.size().numel() * state.element_size()
    return 0


def folder_bytes(path: str) -> int:
    """The bytes of the files under `path` (0 if it is gone)."""
    total = 0
    for folder, _, names in os.walk(path):
        for name in names:
            try:
                total += os.path.getsize(os.path.join(folder, name))
            except OSError:
                pass  # removed meanwhile
    return total


def free_bytes(path: str) -> int:
    """Free bytes of the file system that holds `path` (or would: its nearest existing parent)."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return shutil.disk_usage(path).free


def mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def no_space(root: str, need: int, measured: bool) -> str:
    """`no space left on ROOT: the last checkpoint took N MB, M MB free`."""
    took = f"the last checkpoint took {mb(need)}" if measured else f"a checkpoint takes about {mb(need)}"
    return f"no space left on {root}: {took}, {mb(free_bytes(root))} free"


def causes_of(err: BaseException) -> list[BaseException]:
    """The errors under DCP's per-rank wrapping (CheckpointException: {rank: (exception, traceback)})."""
    return [exc for exc, _ in err.failures.values()] if hasattr(err, "failures") else [err]


def is_full(causes: Iterable[BaseException], partial: str, need: int) -> bool:
    """Whether a save failed for want of space: an ENOSPC/EDQUOT anywhere in its errors (their
    causes and contexts too), or less room left than the part of the checkpoint still unwritten."""
    for err in causes:
        seen: set[int] = set()
        while err is not None and id(err) not in seen:
            if isinstance(err, OSError) and err.errno in FULL or "No space left" in str(err):
                return True
            seen.add(id(err))
            err = err.__cause__ or err.__context__
    return free_bytes(partial) < need - folder_bytes(partial)


def failure(path: str, err: BaseException, full: str | None) -> str:
    """One line naming the folder and the cause: `full` (a no_space line) when the disk is, else
    the OS error underneath DCP's wrapping."""
    if full:
        return f"saving checkpoint {path} failed: {full} (its partial folder is removed)"
    causes = causes_of(err)
    cause = next((c for c in causes if isinstance(c, OSError)), causes[0])
    return f"saving checkpoint {path} failed: {type(cause).__name__}: {cause}"
