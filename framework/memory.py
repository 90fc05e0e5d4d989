"""Activation checkpointing and memory accounting.

Accounting counts the bytes a rank really holds, from the tensors themselves (local shards for
sharded tensors), never from a formula.
"""

from __future__ import annotations

import os
import resource
import sys
from contextlib import contextmanager

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    checkpoint_wrapper,
)

from framework.modules import map_blocks


def apply_activation_checkpointing(model: nn.Module, every: int = 1) -> int:
    """Recompute every `every`-th block of ``model.blocks`` in backward instead of keeping its
    activations: non-reentrant torch.utils.checkpoint. Returns how many blocks were wrapped."""
    try:
        return map_blocks(model, lambda b: checkpoint_wrapper(b, checkpoint_impl=CheckpointImpl.NO_REENTRANT), every)
    except ValueError as err:
        raise ValueError(f"memory=checkpoint: {err} to checkpoint") from None


def _local(t: torch.Tensor) -> torch.Tensor:
    """The part of a (possibly sharded) tensor that lives on this rank."""
    return t.to_local() if hasattr(t, "to_local") else t


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of the part of `t` on this rank (a sharded tensor's local shard)."""
    t = _local(t)
    return t.numel() * t.element_size()


def model_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Parameter, gradient and optimizer-state bytes held by this rank."""
    params = list(model.parameters())
    optim_bytes = 0
    if optimizer is not None:
        for state in optimizer.state.values():
            optim_bytes += sum(tensor_bytes(v) for v in state.values() if isinstance(v, torch.Tensor))
    return {
        "param_bytes": sum(tensor_bytes(p) for p in params),
        "grad_bytes": sum(tensor_bytes(p.grad) for p in params if p.grad is not None),
        "optim_bytes": optim_bytes,
    }


class SavedActivationMeter:
    """Bytes that autograd saves for backward, counted in `saved_tensors_hooks` (works on CPU).

    Storages are counted once (views of one storage share it) and parameters are left out: they
    are model state, not activations. ``peak`` is the most bytes held at once in one `measure`.
    """

    def __init__(self, model: nn.Module):
        self._param_ptrs = {_local(p).untyped_storage().data_ptr() for p in model.parameters()}
        self.peak = 0

    @contextmanager
    def measure(self):
        seen: set[int] = set()
        total = 0

        def pack(t: torch.Tensor) -> torch.Tensor:
            nonlocal total
            if isinstance(t, nn.Parameter) or hasattr(t, "to_local"):  # model state, not activations
                return t
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in seen and ptr not in self._param_ptrs and storage.device.type != "meta":
                seen.add(ptr)
                total += storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield
        self.peak = max(self.peak, total)


def release_cached_memory(device: torch.device) -> None:
    """Return the caching allocator's unused blocks to the device (CUDA). CPU tensors are freed
    to the system allocator at once, so on CPU there is nothing to release: a no-op."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def device_peak_bytes(device: torch.device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def device_reserved_bytes(device: torch.device) -> int | None:
    """Peak bytes the CUDA caching allocator held (allocated + cached)."""
    return torch.cuda.max_memory_reserved(device) if device.type == "cuda" else None


def current_rss_bytes() -> int:
    """Resident set size of this process now (Linux: /proc; elsewhere the peak so far)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return peak_rss_bytes()


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (Linux reports KiB, macOS bytes)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024
