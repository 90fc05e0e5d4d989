"""What a rank's memory peak is made of, caught while it happens.

On a sampled step a thread reads the process's level every millisecond (resident set size on
CPU, the caching allocator's allocated bytes on CUDA). At the step's highest reading it takes
the parts that are live at that instant: model state (parameters, the gradients that exist,
optimizer state), saved activations (from the activation meter), parameters FSDP has gathered
or unsharded, and the buffers of the collective in flight. The parts are read at the same
instant, so they add up to that reading; what they leave of the run's peak is unexplained.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

import torch
from torch import nn

from framework.measure.memory import SavedActivationMeter, _storages, current_rss_bytes

PARTS = ("state_bytes", "activation_bytes", "gathered_bytes", "comm_bytes")


class PeakProbe:
    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, meter: SavedActivationMeter,
                 device: torch.device, interval_s: float = 0.002, step_bytes: int = 2**20):  # fmt: skip
        self._params = list(model.parameters())
        self._optimizer, self._meter, self._device = optimizer, meter, device
        self._interval, self._step_bytes = interval_s, step_bytes
        self._fsdp2 = [m._get_fsdp_state()._fsdp_param_group for m in model.modules() if _is_fsdp2(m)]
        self._fsdp2 = [g for g in self._fsdp2 if g is not None]
        self._fsdp1 = [m._handle.flat_param for m in model.modules() if _is_fsdp1(m) and m._handle is not None]
        self._fixed: tuple[int, set[int], int] | None = (
            None  # parameters and optimizer state: (bytes, storages, states)
        )
        self.level = 0  # the highest reading on the sampled steps
        self.parts: dict[str, int] | None = None  # the parts live at that reading (to within `step_bytes`)

    def _read(self) -> int:
        return torch.cuda.memory_allocated(self._device) if self._device.type == "cuda" else current_rss_bytes()

    @contextmanager
    def watch(self, in_flight=lambda: ()):
        """Sample while the block runs; `in_flight` returns the tensors of collectives not yet done.
        The parts are taken again only when the reading has grown by `step_bytes` since they were
        last taken: taking them walks every tensor of the model state."""
        stop = threading.Event()
        taken_at = [self.level]

        def sample() -> None:
            while not stop.wait(self._interval):
                level = self._read()
                self.level = max(self.level, level)
                if level > taken_at[0] + self._step_bytes or self.parts is None:
                    try:
                        self.parts, taken_at[0] = self._take(in_flight()), level
                    except RuntimeError:  # a container changed under us: the next reading retries
                        continue

        thread = threading.Thread(target=sample, name="peak-probe", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()

    def _fixed_parts(self) -> tuple[int, set[int]]:
        """Parameter and optimizer-state bytes and storages, counted again only when the optimizer
        has created state (its first step)."""
        states = len(self._optimizer.state)
        if self._fixed is None or self._fixed[2] != states:
            seen: set[int] = set()
            optim = [v for st in list(self._optimizer.state.values()) for v in st.values() if torch.is_tensor(v)]
            total = self._size(self._params, seen) + self._size(optim, seen)
            self._fixed = (total, seen, states)
        return self._fixed[0], self._fixed[1]

    def _size(self, tensors, seen: set[int]) -> int:
        return storage_bytes(tensors, seen, self._device)

    def _take(self, in_flight) -> dict[str, int]:
        fixed, fixed_storages = self._fixed_parts()
        seen = set(fixed_storages)
        state = fixed + self._size([p.grad for p in self._params if p.grad is not None], seen)
        unsharded = [fp for g in self._fsdp2 for fp in g.fsdp_params]
        gathered = self._size([t for fp in unsharded for t in fp.all_gather_outputs], seen)
        gathered += self._size([p.grad for fp in unsharded if (p := getattr(fp, "_unsharded_param", None)) is not None
                           and p.grad is not None], seen)  # fmt: skip
        gathered += self._size([f._full_param_padded for f in self._fsdp1 if hasattr(f, "_full_param_padded")], seen)
        pending = [r.all_gather_output for g in self._fsdp2 if (r := g._all_gather_result) is not None]
        comm = self._size(pending, seen) + self._size(in_flight, seen)
        return {"state_bytes": state, "activation_bytes": self._meter.live, "gathered_bytes": gathered,
                "comm_bytes": comm}  # fmt: skip


def storage_bytes(tensors, seen: set[int], device: torch.device) -> int:
    """Bytes of the storages under `tensors` that live on `device` (the memory a reading
    measures: the CUDA allocator's, or on a CPU the RSS) and are not in `seen` (which it
    extends). Under FSDP CPU offload the shards and optimizer state live in host memory: they
    are not part of a CUDA reading, and counting them there made `unexplained_bytes` negative."""
    total = 0
    for t in tensors:
        for s in _storages(t):
            if s.device.type == device.type and s.data_ptr() not in seen and s.nbytes() > 0:
                seen.add(s.data_ptr())
                total += s.nbytes()
    return total


def _is_fsdp2(module: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def _is_fsdp1(module: nn.Module) -> bool:
    from torch.distributed.fsdp import FullyShardedDataParallel

    return isinstance(module, FullyShardedDataParallel)
