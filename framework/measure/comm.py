"""Communication accounting: the collectives a rank really issues, counted as they are dispatched.

Every process-group call (DDP's bucket all-reduces from its C++ reducer, FSDP's all-gathers and
reduce-scatters, tensor parallel's functional collectives, a pipeline's sends and receives) goes
through torch's dispatcher as a ``c10d`` / ``_c10d_functional`` op; a TorchDispatchMode sees each
one with its tensors and process group: which collectives run, how often, on which group, with
how many bytes is observed, not predicted.

Per call two figures:
- ``bytes``: the payload, measured: the tensor data the collective is about (an all-reduce's
  tensor, an all-gather's gathered output, a reduce-scatter's full input, a send's tensor, the
  rows an all-to-all sends, its own share included);
- ``wire_bytes``: a model, not a measurement: what this rank would send under the standard ring
  algorithms for its group of N (all-reduce 2(N-1)/N x payload, a reduce-scatter then an
  all-gather; all-gather, reduce-scatter and broadcast (N-1)/N x payload; send the payload).
  Backends pick other algorithms (NCCL's trees, gloo's halving-doubling) and add headers, so
  the bytes on a real link differ.

Counting runs Python for every op while active, so the trainer samples a few steps.
"""

from __future__ import annotations

import functools
import weakref
from collections import defaultdict, deque
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack
from torch.utils._pytree import tree_leaves

from framework.measure.memory import tensor_bytes

# dispatcher op name (without overload) -> category
OPS = {
    "allreduce_": "all_reduce",
    "allreduce_coalesced_": "all_reduce",
    "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "_allgather_base_": "all_gather",
    "allgather_": "all_gather",
    "allgather_coalesced_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "broadcast_": "broadcast",
    "broadcast": "broadcast",
    "send": "send",
    "recv_": "recv",
    "recv_any_source_": "recv",
    "alltoall_": "all_to_all",
    "alltoall_base_": "all_to_all",
    "all_to_all_single": "all_to_all",
    "barrier": "barrier",
}

RING_FACTOR = {  # wire bytes per payload byte for a group of n ranks
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "broadcast": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "send": lambda n: 1.0,
    "recv": lambda n: 0.0,  # the peer's send counts it
    "barrier": lambda n: 0.0,
}


def _nbytes(obj: Any) -> int:
    """Bytes of every tensor in `obj` (a tensor, or a list of them)."""
    return sum(tensor_bytes(t) for t in tree_leaves(obj) if isinstance(t, torch.Tensor))


def _group_size(op: str, args: tuple, kwargs: dict) -> int:
    """The size of the process group an op runs on (a ProcessGroup object, a group size, or a
    functional collective's group name). Raises when there is none: guessing the world size
    would silently misstate the wire bytes of every sub-group collective."""
    import torch.distributed as dist

    for a in (*args, *kwargs.values()):
        if isinstance(a, dist.ProcessGroup):
            return a.size()
        if isinstance(a, torch.ScriptObject):  # c10d ops carry the group boxed (a ReduceOp is too)
            try:
                return dist.ProcessGroup.unbox(a).size()
            except RuntimeError:
                continue
    if "group_size" in kwargs:
        return int(kwargs["group_size"])
    for a in args:
        if isinstance(a, str):
            try:
                return dist.distributed_c10d._resolve_process_group(a).size()
            except Exception:  # not a group name
                continue
    raise ValueError(f"communication accounting: cannot tell the process group of {op}")


def _tensors(args) -> list[torch.Tensor]:
    return [t for a in args for t in (a if isinstance(a, list | tuple) else [a]) if isinstance(t, torch.Tensor)]


def payload_bytes(op: str, args: tuple, kwargs: dict) -> int:
    """The collective's payload: the biggest of its tensor arguments (the gathered output of an
    all-gather, the full input of a reduce-scatter, the tensor of the others); an all-to-all's
    input (what this rank sends: what it receives depends on the others)."""
    name = op.split(".")[1] if "." in op else op
    if name == "all_gather_into_tensor":  # functional: only the shard is an argument
        return _nbytes(args[0]) * int(args[1])
    if name in ("alltoall_", "alltoall_base_"):  # (outputs, inputs, ...)
        return _nbytes(args[1])
    if name == "all_to_all_single":  # functional: (input, ...)
        return _nbytes(args[0])
    return max((_nbytes(a) for a in args if isinstance(a, torch.Tensor | list | tuple)), default=0)


# torch.distributed functions that communication hooks may call from other threads (PowerSGD
# issues its second all-reduce in a future's callback): category of each
PY_COLLECTIVES = {
    "all_reduce": "all_reduce",
    "all_gather_into_tensor": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "broadcast": "broadcast",
    "all_gather": "all_gather",
    "reduce_scatter": "reduce_scatter",
}


_UNSEEN = object()
_CATEGORY: dict[Any, str | None] = {}  # op -> its collective category (None: not a collective)


class CommCounter(TorchDispatchMode):
    """Counts collectives issued while active (use as a context manager).

    A dispatch mode is active per thread: where it is, it sees every collective; torch's
    autograd carries it into the device threads that run a CUDA backward (with DDP's comm hooks
    and FSDP2's HSDP all-reduce in them). Collectives issued on a thread without it (a comm
    hook's future callbacks on the backend's threads: PowerSGD's second all-reduce) are caught at
    the torch.distributed level instead, and counted there only when the mode is not active on
    the issuing thread: each collective is counted once, on whichever thread it runs."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """Compiled regions run compiled under it, not eager (dynamo skips them under a mode that
        would see their operators): a sampled step of a compile=true run measured eager's saved
        activations and time. No compiled region holds a collective (FSDP's and DDP's run in
        hooks outside them; compile refuses tensor, context and expert parallel)."""
        return True

    def __init__(self) -> None:
        super().__init__()
        self.calls: dict[str, int] = defaultdict(int)
        self.bytes: dict[str, int] = defaultdict(int)
        self.wire: dict[str, float] = defaultdict(float)
        self._originals: dict[str, Any] = {}
        self._issued: deque[list] = deque(maxlen=4)  # weak references to recent collectives' tensors

    def _record(self, category: str, size: int, group_size: int) -> None:
        self.calls[category] += 1
        self.bytes[category] += size
        self.wire[category] += size * RING_FACTOR[category](group_size)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        category = _CATEGORY.get(func, _UNSEEN)
        if category is _UNSEEN:  # once per op: naming an op costs more than running most small ones
            namespace, _, rest = str(func).partition(".")
            collective = namespace in ("c10d", "_c10d_functional")
            category = _CATEGORY[func] = OPS.get(rest.split(".")[0]) if collective else None
        if category is not None:
            self._record(category, payload_bytes(str(func), args, kwargs), _group_size(str(func), args, kwargs))
            self._issued.append([weakref.ref(t) for t in _tensors(args)])
        return func(*args, **kwargs)

    def in_flight(self) -> list[torch.Tensor]:
        """The tensors of the latest collectives that something (the backend's work, the caller)
        still holds: a collective's buffers live until its work completes, after the call returns."""
        return [t for refs in list(self._issued) for ref in refs if (t := ref()) is not None]

    def __enter__(self):
        import torch.distributed as dist

        for name, category in PY_COLLECTIVES.items():
            original = self._originals[name] = getattr(dist, name)
            setattr(dist, name, self._off_thread_counter(original, category))
        return super().__enter__()

    def __exit__(self, *exc):
        import torch.distributed as dist

        for name, original in self._originals.items():
            setattr(dist, name, original)
        return super().__exit__(*exc)

    def active_here(self) -> bool:
        """Whether this mode is active on the calling thread (it then sees the thread's collectives)."""
        return any(mode is self for mode in _get_current_dispatch_mode_stack())

    def _off_thread_counter(self, original, category: str):
        import torch.distributed as dist

        @functools.wraps(original)
        def counted(*args, **kwargs):
            if not self.active_here():  # else the dispatch mode counts it
                group = kwargs.get("group")
                self._record(category, payload_bytes(category, args, kwargs), dist.get_world_size(group))
            return original(*args, **kwargs)

        return counted

    def totals(self) -> dict[str, Any]:
        return {
            "calls": sum(self.calls.values()),
            "bytes": sum(self.bytes.values()),
            "wire_bytes": round(sum(self.wire.values())),
            "by_op": {op: {"calls": self.calls[op], "bytes": self.bytes[op]} for op in sorted(self.calls)},
        }


def mean_totals(samples: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Per-step figures averaged over the sampled steps."""
    if not samples:
        return None
    n = len(samples)
    ops = sorted({op for s in samples for op in s["by_op"]})
    return {
        "calls": sum(s["calls"] for s in samples) / n,
        "bytes": sum(s["bytes"] for s in samples) / n,
        "wire_bytes": sum(s["wire_bytes"] for s in samples) / n,
        "by_op": {
            op: {k: sum(s["by_op"].get(op, {}).get(k, 0) for s in samples) / n for k in ("calls", "bytes")}
            for op in ops
        },
        "sampled_steps": n,
    }
