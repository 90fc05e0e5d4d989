"""Memory accounting (the levers that save memory are framework/levers/).

Accounting counts the bytes a rank really holds, from the tensors themselves (local shards for
sharded tensors), never from a formula.
"""

from __future__ import annotations

import ctypes
import functools
import os
import resource
import subprocess
import sys
import threading
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.utils._python_dispatch import is_traceable_wrapper_subclass


def _local(t: torch.Tensor) -> torch.Tensor:
    """The part of a (possibly sharded) tensor that lives on this rank."""
    return t.to_local() if hasattr(t, "to_local") else t


def _storages(t: torch.Tensor, fake: bool = False) -> list:
    """The storages holding `t`'s data on this rank: a wrapper subclass's (a DTensor's local
    shard, an async collective's result) through its inner tensors, read without running an op
    (this runs inside saved-tensor hooks). Storages that cannot be read are left out (`fake`:
    fake tensors' storages, which hold no data but have a size, are read too)."""
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        inner = (getattr(t, name) for name in names)
        return [s for x in inner if isinstance(x, torch.Tensor) for s in _storages(x, fake)]
    try:
        storage = t.untyped_storage()
        if not fake:
            storage.data_ptr()
    except RuntimeError:  # a storage-less tensor (fake, or freed by its owner)
        return []
    return [storage]


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of the part of `t` on this rank (a sharded tensor's local shard)."""
    t = _local(t)
    return t.numel() * t.element_size()


def model_state_bytes(
    model: nn.Module, optimizer: torch.optim.Optimizer | None = None, device: torch.device | None = None
) -> dict[str, int]:
    """Parameter, gradient and optimizer-state bytes held by this rank, wherever they live; with
    `device` (the compute device), also `offloaded_bytes`: the part of them held elsewhere (FSDP
    CPU offload keeps shards, gradients and optimizer state in host memory)."""
    params = list(model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    optim = [v for st in (optimizer.state.values() if optimizer is not None else ()) for v in st.values()
             if isinstance(v, torch.Tensor)]  # fmt: skip
    state = {
        "param_bytes": sum(tensor_bytes(p) for p in params),
        "grad_bytes": sum(tensor_bytes(g) for g in grads),
        "optim_bytes": sum(tensor_bytes(v) for v in optim),
    }
    if device is not None:
        state["offloaded_bytes"] = sum(tensor_bytes(t) for t in (*params, *grads, *optim) if not lives_on(t, device))
    return state


# The meters measuring now: a memory lever that keeps tensors for backward outside autograd
# (selective checkpointing's cache) reports them; one whose saved-tensor hooks stand in front of
# the meter's (activation offload) hands the tensors it leaves on the device to the meter's hooks
_MEASURING: list[tuple[Callable, Callable, Callable]] = []  # (keep, pack, unpack) of each


def kept_for_backward(t: torch.Tensor) -> None:
    """Count `t` in every meter measuring now, until its measurement ends (the saved bytes peak at
    the turn from forward to backward, which it spans)."""
    for keep, _, _ in _MEASURING:
        keep(t)


def meter_hooks() -> tuple[Callable, Callable] | None:
    """The (pack, unpack) saved-tensor hooks of the innermost meter measuring now, or None."""
    return _MEASURING[-1][1:] if _MEASURING else None


def lives_on(t: torch.Tensor, device: torch.device) -> bool:
    """Whether (the local part of) `t` is held in `device`'s memory: what that device's memory
    reading (the CUDA allocator's, or the process RSS for the CPU) contains."""
    return _local(t).device.type == device.type


class SavedActivationMeter:
    """Bytes that autograd keeps for backward, live, counted in `saved_tensors_hooks` (works on CPU).

    A saved tensor counts from the forward op that saves it until autograd releases it in
    backward; ``peak`` is the most bytes live at once in one `measure` (one micro-batch's forward
    and backward; a pipeline's whole schedule, so its in-flight micro-batches). Storages count
    once (views share them), a sharded tensor (DTensor under tensor or sequence parallel) by its
    local storage, and parameters (and views of them, such as
    the transposed weight a linear saves, FSDP's gathered ones included) not at all: they are model state. A checkpointed block saves
    nothing through these hooks (checkpointing installs its own): its input, which it keeps for
    the recomputation, counts from the block's forward to the end of the step; the recomputed
    tensors, one block's worth at a time in backward, are not counted.
    """

    def __init__(self, model: nn.Module, fake: bool = False):
        """`fake`: the model and its inputs are fake tensors (the planner's dry run): storages are
        told apart by their identity instead of their (absent) data."""
        self._model = model
        self._fake = fake
        self._param_ptrs = {self._key(s) for p in model.parameters() for s in _storages(p, fake)}
        self.peak = 0
        self.live = 0  # bytes held now (inside `measure`)

    @contextmanager
    def measure(self):
        live: dict[int, list[int]] = {}  # storage pointer -> [references, bytes]
        peak = [0]
        lock = threading.Lock()  # parallel=dp: replica threads pack and release at the same time

        def hold(ptr: int, nbytes: int) -> None:
            with lock:
                entry = live.setdefault(ptr, [0, nbytes])
                if entry[0] == 0:  # (again: a freed storage's address can come back with another size)
                    entry[1] = nbytes
                    self.live += nbytes
                    peak[0] = max(peak[0], self.live)
                entry[0] += 1

        def release(ptr: int) -> None:
            with lock:
                entry = live[ptr]
                entry[0] -= 1
                if entry[0] == 0:
                    self.live -= entry[1]

        def pack(t: torch.Tensor):
            if isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter) or is_weight(t):  # a weight, a view
                return t
            ptrs = self._counted(t)
            for ptr, nbytes in ptrs:
                hold(ptr, nbytes)
            # detached: a tensor that is its own op's output (SDPA's, a tanh's) would otherwise hold
            # that op's node, which holds this packed object: a cycle through autograd's C++ that
            # no collector breaks. Backward breaks it; a forward never backwarded (a pipeline's
            # first stage runs one to infer its shapes) would keep its graph, and these bytes
            # counted, for the rest of the run. Autograd restores the grad_fn as it unpacks.
            return _Saved(t.detach(), [ptr for ptr, _ in ptrs], release) if ptrs else t

        def kept_by_a_lever(t: torch.Tensor) -> None:  # held until the measurement ends
            for ptr, nbytes in self._counted(t):
                hold(ptr, nbytes)
                kept.append(ptr)

        def checkpointed_input(module, args):
            for t in args:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    kept_by_a_lever(t)

        kept: list[int] = []
        hooks = [m.register_forward_pre_hook(checkpointed_input) for m in self._model.modules()
                 if isinstance(m, CheckpointWrapper)]  # fmt: skip
        _MEASURING.append(measuring := (kept_by_a_lever, pack, _unpack))
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
                yield
        finally:
            _MEASURING.remove(measuring)
            for h in hooks:
                h.remove()
            for ptr in kept:
                release(ptr)
        self.peak = max(self.peak, peak[0])

    def _counted(self, t: torch.Tensor) -> list[tuple[int, int]]:
        """(key, bytes) of each of `t`'s storages that counts: not a parameter's, not on meta, not empty."""
        return [
            (self._key(s), s.nbytes())
            for s in _storages(t, self._fake)
            if self._key(s) not in self._param_ptrs and (self._fake or s.device.type != "meta") and s.nbytes() > 0
        ]

    def _key(self, storage) -> int:
        return storage._cdata if self._fake else storage.data_ptr()


def mark_weight(t: torch.Tensor) -> torch.Tensor:
    """Mark `t` (a parameter's data taken out of it: a DTensor parameter's local tensor, which expert
    parallel computes with) and its views as model state, which the meter does not count."""
    (t._base if t._base is not None else t)._hydradist_weight = True
    return t


def is_weight(t: torch.Tensor) -> bool:
    return getattr(t._base if t._base is not None else t, "_hydradist_weight", False)


class _Saved:
    """A tensor autograd saved, as packed: releases its bytes when autograd lets it go."""

    __slots__ = ("tensor", "ptrs", "release")

    def __init__(self, tensor: torch.Tensor, ptrs: list[int], release):
        self.tensor, self.ptrs, self.release = tensor, ptrs, release

    def __del__(self):
        for ptr in self.ptrs:
            self.release(ptr)


def _unpack(packed):
    return packed.tensor if isinstance(packed, _Saved) else packed


def release_cached_memory(device: torch.device) -> None:
    """Return unused cached memory: the CUDA caching allocator's free blocks to the device; on CPU
    (glibc) the malloc heaps' free pages to the system (`malloc_trim`)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
    elif _libc() is not None:
        _libc().malloc_trim(0)


HOST_ALLOCATORS = ("auto", "lean", "steady", "glibc")
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters


def host_allocator(configured: str, parallel: str) -> str:
    """The host allocator policy a run uses: `auto` is lean where FSDP gathers and frees each
    unit's parameters (fsdp, hybrid, cp), steady elsewhere."""
    if configured != "auto":
        return configured
    return "lean" if parallel in ("fsdp", "hybrid", "cp") else "steady"


def set_host_allocator(policy: str) -> bool:
    """Tune glibc's malloc for training (`mallopt`; elsewhere than glibc nothing changes).

    glibc's defaults adapt as a process runs: its mmap threshold rises to the size of each large
    block freed (up to 32 MiB) and its trim threshold with it. Blocks below the threshold come
    from the heaps, which return their free top to the system when it passes the trim threshold.
    - `lean`: blocks of 1 MiB and more get their own mapping, returned when freed. FSDP frees
      each unit's gathered parameters and reduce-scatter buffers all step long; from the heaps
      that space would stay in the process (docs/host_allocator.md; docs/results/memory_rss.md).
    - `steady`: blocks up to 32 MiB come from the heaps, which keep up to 512 MiB of free top.
      A steady step allocates the same sizes every step: they are served again without the
      system trimming them and the next forward faulting them back in (under glibc's adaptive
      thresholds a steady step's forward slows when a trim lands between steps).
    - `glibc`: leave glibc's adaptive defaults.
    Returns whether a policy was applied."""
    libc = _libc()
    if policy == "glibc" or libc is None:
        return False
    if policy == "lean":
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, 1024 * 1024))
    return bool(
        libc.mallopt(_M_MMAP_THRESHOLD, 32 * 1024 * 1024) and libc.mallopt(_M_TRIM_THRESHOLD, 512 * 1024 * 1024)
    )


@functools.cache
def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


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
    """Peak resident set size of this process since `reset_peak_rss` (Linux: VmHWM; elsewhere the
    process's lifetime peak, which macOS reports in bytes and others in KiB)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return rss if sys.platform == "darwin" else rss * 1024


def peak_rss_of(cmd: list[str], **popen: Any) -> int:
    """Run `cmd` to its end and return the peak RSS (bytes) of its largest process, the command's
    own or any of its descendants': read from outside, by the parent that waits for it (POSIX
    `wait4`). Raises CalledProcessError when the command fails."""
    proc = subprocess.Popen(cmd, **popen)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise subprocess.CalledProcessError(proc.returncode, cmd)
    return usage.ru_maxrss if sys.platform == "darwin" else usage.ru_maxrss * 1024


def reset_peaks(device: torch.device) -> None:
    """Start this run's peaks from now, should the process have trained before (a multirun's
    in-process jobs, run_configs): the RSS peak, and on CUDA the allocator's peak statistics
    (`max_memory_allocated` and `max_memory_reserved` would otherwise keep an earlier job's)."""
    reset_peak_rss()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def reset_peak_rss() -> None:
    """Start the peak over from the current RSS (Linux), so a process that trains several runs
    one after another reports each run's own peak."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
