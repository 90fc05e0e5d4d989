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

from framework.memory import SavedActivationMeter, _storages, current_rss_bytes

PARTS = ("state_bytes", "activation_bytes", "gathered_bytes", "comm_bytes")


class PeakProbe:
    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, meter: SavedActivationMeter,
                 device: torch.device, interval_s: float = 0.001):  # fmt: skip
        self._params = list(model.parameters())
        self._optimizer, self._meter, self._device, self._interval = optimizer, meter, device, interval_s
        self._fsdp2 = [m._get_fsdp_state()._fsdp_param_group for m in model.modules() if _is_fsdp2(m)]
        self._fsdp2 = [g for g in self._fsdp2 if g is not None]
        self._fsdp1 = [m._handle.flat_param for m in model.modules() if _is_fsdp1(m) and m._handle is not None]
        self.level = 0  # the highest reading on the sampled steps
        self.parts: dict[str, int] | None = None  # the parts live at that reading

    def _read(self) -> int:
        return torch.cuda.memory_allocated(self._device) if self._device.type == "cuda" else current_rss_bytes()

    @contextmanager
    def watch(self, in_flight=lambda: ()):
        """Sample while the block runs; `in_flight` returns the tensors of collectives not yet done."""
        stop = threading.Event()

        def sample() -> None:
            while not stop.wait(self._interval):
                level = self._read()
                if level > self.level:
                    try:
                        parts = self._take(in_flight())
                    except RuntimeError:  # a container changed under us: the next reading retries
                        continue
                    self.level, self.parts = level, parts

        thread = threading.Thread(target=sample, name="peak-probe", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()

    def _take(self, in_flight) -> dict[str, int]:
        seen: set[int] = set()

        def size(tensors) -> int:
            total = 0
            for t in tensors:
                for s in _storages(t):
                    if s.data_ptr() not in seen and s.nbytes() > 0:
                        seen.add(s.data_ptr())
                        total += s.nbytes()
            return total

        state = size(self._params)
        state += size([p.grad for p in self._params if p.grad is not None])
        state += size([v for st in list(self._optimizer.state.values()) for v in st.values() if torch.is_tensor(v)])
        unsharded = [fp for g in self._fsdp2 for fp in g.fsdp_params]
        gathered = size([t for fp in unsharded for t in fp.all_gather_outputs])
        gathered += size([p.grad for fp in unsharded if (p := getattr(fp, "_unsharded_param", None)) is not None
                          and p.grad is not None])  # fmt: skip
        gathered += size([f._full_param_padded for f in self._fsdp1 if hasattr(f, "_full_param_padded")])
        pending = [r.all_gather_output for g in self._fsdp2 if (r := g._all_gather_result) is not None]
        comm = size(pending) + size(in_flight)
        return {"state_bytes": state, "activation_bytes": self._meter.live, "gathered_bytes": gathered,
                "comm_bytes": comm}  # fmt: skip


def _is_fsdp2(module: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def _is_fsdp1(module: nn.Module) -> bool:
    from torch.distributed.fsdp import FullyShardedDataParallel

    return isinstance(module, FullyShardedDataParallel)
