"""parallel=dp: torch.nn.DataParallel, one process driving every visible GPU, each replica's
forward in a thread of its own.

Two states the forward depends on are per thread, and DataParallel's threads do not inherit
them: the autocast dtype (its threads re-enter autocast with the enabled flag only, so
precision=bf16 would compute in autocast's default, float16) and the saved-tensor hooks (the
activation meter's: dp's activation bytes would read about 0). `CallerState` takes both in the
calling thread and `InCallerState` re-enters them around each replica's forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class CallerState:
    """The calling thread's autocast state per device type and its innermost saved-tensor hooks."""

    autocast: tuple[tuple[str, bool, torch.dtype], ...]
    saved_tensor_hooks: tuple | None

    @classmethod
    def capture(cls, device_types: Sequence[str] = ("cuda", "cpu")) -> CallerState:
        autocast = tuple((d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in device_types)
        return cls(autocast, torch._C._autograd._top_saved_tensors_default_hooks(False))


class InCallerState:
    """Calls `module` under `state` (in whichever thread calls it): what a replica thread runs."""

    def __init__(self, module: nn.Module, state: CallerState):
        self.module, self.state = module, state

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with ExitStack() as stack:
            for device_type, enabled, dtype in self.state.autocast:
                if enabled:
                    stack.enter_context(torch.autocast(device_type, dtype=dtype))
            if self.state.saved_tensor_hooks is not None:
                stack.enter_context(torch.autograd.graph.saved_tensors_hooks(*self.state.saved_tensor_hooks))
            return self.module(*args, **kwargs)


class DataParallel(nn.DataParallel):
    """nn.DataParallel whose replica threads compute in the caller's autocast dtype and record
    into the caller's saved-tensor hooks (same module tree and state dict as nn.DataParallel)."""

    def parallel_apply(self, replicas: Sequence[nn.Module], inputs: Sequence[Any], kwargs: Any) -> list[Any]:
        state = CallerState.capture()
        return super().parallel_apply([InCallerState(r, state) for r in replicas], inputs, kwargs)


def apply_dp(model: nn.Module) -> nn.Module:
    return DataParallel(model)
