"""Activation offload (`memory=offload_activations`): what a block saves for backward goes to host
memory as the forward makes it and comes back when its backward needs it, through saved-tensor
hooks around each block. On CUDA the copies go to pinned memory on a side stream, overlapped with
the forward's compute (the stream's order keeps each copy after the op that made its tensor, and
the backward waits for it before reading it back). On the CPU the host is the device: the tensors
stay where they are and the meter counts them, as it counts any saved tensor there.

Parameters (and views of them, the transposed weight a linear saves) are model state and stay;
only activations move. A DTensor (tensor or sequence parallel) stays too: its local shard would
need its layout back.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from framework.measure.memory import is_weight, meter_hooks
from framework.modules import map_blocks


class ActivationOffload:
    """The pack and unpack hooks of one model's blocks, with the side stream their copies share."""

    def __init__(self):
        self.stream: torch.cuda.Stream | None = None  # made at the first CUDA tensor (a CPU run makes none)

    def pack(self, t: torch.Tensor):
        weight = isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter) or is_weight(t)
        if weight or t.device.type != "cuda" or is_traceable_wrapper_subclass(t):
            # stays on the device (on the CPU the host is the device; a DTensor keeps its layout): the meter's to count
            meter = meter_hooks()
            return (None, meter, meter[0](t)) if meter is not None else t
        host = torch.empty(t.size(), dtype=t.dtype, layout=t.layout, pin_memory=True)
        self.stream = self.stream or torch.cuda.Stream(t.device)
        self.stream.wait_stream(torch.cuda.current_stream(t.device))  # after the op that made it
        with torch.cuda.stream(self.stream):
            host.copy_(t, non_blocking=True)
        t.record_stream(self.stream)  # its memory waits for the copy before it is reused
        return t.device, host

    def unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        if packed[0] is None:  # left on the device, packed by the meter
            return packed[1][1](packed[2])
        device, host = packed
        torch.cuda.current_stream(device).wait_stream(self.stream)  # the copy out has finished
        return host.to(device, non_blocking=True)


def _offload_around(block: nn.Module, offload: ActivationOffload) -> nn.Module:
    """The block itself, its forward now inside `offload`'s saved-tensor hooks (entered before it
    runs and left after it, even when it raises): its parameter names and type stay as they were."""
    entered: list = []

    def enter(module, args):
        entered.append(torch.autograd.graph.saved_tensors_hooks(offload.pack, offload.unpack))
        entered[-1].__enter__()

    def leave(module, args, output):
        entered.pop().__exit__(None, None, None)

    block.register_forward_pre_hook(enter)
    block.register_forward_hook(leave, always_call=True)
    return block


def apply_activation_offload(model: nn.Module, blocks: str | None) -> int:
    """Offload what every block saves; returns how many blocks."""
    offload = ActivationOffload()
    try:
        return map_blocks(model, blocks, lambda b: _offload_around(b, offload))
    except ValueError as err:
        raise ValueError(f"memory=offload_activations: {err} to offload from") from None
