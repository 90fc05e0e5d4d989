"""The link between local ranks, probed once per machine and world (a few seconds; cached by
framework.plan.profile): all-reduce latency and bandwidth fitted on a small and a large message,
and what a small call costs back to back, as a step issues it, for each collective and for each
path that issues one:

- the bare collective (DDP's buckets, a pipeline's sends);
- `tp:` one of tensor parallel's collectives with DTensor's dispatch around it, from a few small
  column- and row-wise pairs' forward and backward (with and without sequence parallel);
- `fsdp:` one of FSDP2's collectives with the hooks, copies and waits around it, from a few small
  units' forward and backward;

each against the same layers whole.

On an oversubscribed CPU (more ranks than cores) each call waits for its peers to be scheduled,
which a single timed call after a barrier hides.
"""

from __future__ import annotations

import statistics
import time

import torch

from framework.machine import launch_local


def probe_link(world: int, device: str) -> dict[str, float]:
    """Fit latency and bandwidth of all-reduce among `world` local workers, and each collective's
    own bandwidth (a few seconds)."""
    samples, by_op, bandwidth = launch_local(world, _probe_worker, device)[0]
    (n0, t0), (n1, t1) = samples[0], samples[-1]
    per_byte = max((t1 - t0) / (n1 - n0), 1e-12)
    return {"bytes_per_s": 1 / per_byte, "latency_s": max(t0 - n0 * per_byte, 1e-6), "by_op": by_op,
            "bytes_per_s_by_op": bandwidth}  # fmt: skip


def probe_sizes(device: str) -> tuple[int, ...]:
    """fp32 elements of the probe's all-reduces, smallest to largest (the fit takes the ends): a
    16 MB message saturates gloo's sockets, but not NVLink or InfiniBand, whose large-message
    bandwidth needs a few hundred MB (256 MB here) to show."""
    return (1024, 4 * 1024**2, 64 * 1024**2) if device == "cuda" else (1024, 4 * 1024**2)


def _probe_worker(device: str) -> tuple[list[tuple[float, float]], dict[str, float], dict[str, float]]:
    """((wire bytes, seconds) of a small and a large all-reduce, the median of a few each;
    {collective: seconds a small call takes back to back}; {collective: its wire bytes per second})."""
    import torch.distributed as dist

    from framework.dist import destroy_distributed, init_distributed
    from framework.measure.comm import RING_FACTOR

    init_distributed(device, "nccl" if device == "cuda" else "gloo", timeout_s=60)
    try:
        world, out = dist.get_world_size(), []
        dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
        for numel in probe_sizes(device):
            x = torch.ones(numel, device=dev)
            times = []
            for _ in range(10):
                dist.barrier()
                t0 = time.perf_counter()
                dist.all_reduce(x)
                if device == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            out.append((4 * numel * RING_FACTOR["all_reduce"](world), statistics.median(times[1:])))
        small = _back_to_back(world, dev)
        bandwidth = _bandwidths(world, dev, 1024**2, small)
        return out, small | _strategy_paths(world, dev, bandwidth), bandwidth
    finally:
        destroy_distributed()


def _into_one_tensor() -> tuple:
    """(all-gather, reduce-scatter) into and from one tensor: torch's `*_single` where it has them
    (it deprecates the older names, which torch before 2.14 alone has); looked up once, outside
    the timed calls."""
    import torch.distributed as dist

    return (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor,
            getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)  # fmt: skip


def _back_to_back(world: int, dev: torch.device, calls: int = 20) -> dict[str, float]:
    """{collective: seconds a small call takes when calls follow each other}."""
    import torch.distributed as dist

    rank, x = dist.get_rank(), torch.ones(1024, device=dev)
    gathered = torch.empty(1024 * world, device=dev)
    all_gather, reduce_scatter = _into_one_tensor()
    ops = {
        "all_reduce": lambda: dist.all_reduce(x),
        "all_gather": lambda: all_gather(gathered, x),
        "reduce_scatter": lambda: reduce_scatter(x, gathered),
        "send": lambda: _ping_pong(x, rank, world),
    }
    out = {name: _per_call(call, dev, calls) for name, call in ops.items()}
    out["send"] /= 2  # a ping-pong is two messages
    return out


def _bandwidths(world: int, dev: torch.device, numel: int, small: dict[str, float]) -> dict[str, float]:
    """{collective: wire bytes per second of a `numel` call (4 MB in fp32, an FSDP unit's or a DDP
    bucket's size) beyond a small one's seconds}: backends
    implement each collective alike in bytes but not in speed (gloo's reduce-scatter runs at a
    fraction of its all-reduce's rate)."""
    import torch.distributed as dist

    from framework.measure.comm import RING_FACTOR

    x = torch.ones(numel, device=dev)
    full = torch.empty(numel * world, device=dev)
    all_gather, reduce_scatter = _into_one_tensor()
    ops = {  # payload: the full tensor, as framework.measure.comm counts it
        "all_reduce": (lambda: dist.all_reduce(x), numel),
        "all_gather": (lambda: all_gather(full, x), numel * world),
        "reduce_scatter": (lambda: reduce_scatter(x, full), numel * world),
    }  # (a pipeline's sends: the all-reduce's rate; a ping-pong's small-message time is too jittery here to subtract)
    out = {}
    for name, (call, payload) in ops.items():
        seconds = _per_call(call, dev, 5) - small[name]
        out[name] = 4 * payload * RING_FACTOR[name](world) / max(seconds, 1e-9)
    return out


def _per_call(call, dev: torch.device, calls: int) -> float:
    """The median seconds of `calls` back-to-back calls (this machine's scheduler is jittery: a
    few calls wait a whole time slice)."""
    import torch.distributed as dist

    call()
    dist.barrier()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        call()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _strategy_paths(world: int, dev: torch.device, bandwidth: dict[str, float], units: int = 4) -> dict[str, float]:
    """Seconds a collective costs beyond its bytes as tensor parallel and FSDP2 issue it: a few
    layers' forward and backward, parallelized, against the same layers whole, per collective
    they issue, less its wire bytes at that collective's `bandwidth`. The layers are a small
    model's (width 256, 512 tokens a rank): each rank computes between the calls, as in training,
    so a call also waits for the peers the scheduler ran late."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from framework.measure.comm import RING_FACTOR

    width, rows = 256, 512
    mesh = init_device_mesh(dev.type, (world,))
    x = torch.randn(rows, width, device=dev)

    def layers(wrap=None) -> torch.nn.Module:
        net = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(2 * units))).to(dev)
        if wrap is not None:
            wrap(net)
        return net

    def fsdp(net):
        for layer in net:
            fully_shard(layer, mesh=mesh)
        fully_shard(net, mesh=mesh)

    def tp(sequence_parallel: bool):
        into, out = ({"input_layouts": Shard(0)}, {"output_layouts": Shard(0)}) if sequence_parallel else ({}, {})
        plan = {f"{i}": ColwiseParallel(**into) if i % 2 == 0 else RowwiseParallel(**out) for i in range(2 * units)}
        return lambda net: parallelize_module(net, mesh, plan)

    def extra(wrap, calls: dict[str, float], payload: int, inputs: torch.Tensor = x) -> float:
        step = lambda net: net(inputs).sum().backward()  # noqa: E731
        plain, wrapped = layers(), layers(wrap)
        seconds = _per_call(lambda: step(wrapped), dev, 5) - _per_call(lambda: step(plain), dev, 5)
        wire = sum(n * payload * RING_FACTOR[op](world) / bandwidth[op] for op, n in calls.items())
        return max(seconds - wire, 0.0) / sum(calls.values())

    activation, weight = 4 * rows * width, 4 * width * (width + 1)
    pairs = units  # per pair: gather in, reduce-scatter out, and back
    gathered = extra(tp(True), {"all_gather": 2 * pairs, "reduce_scatter": 2 * pairs}, activation, x[: rows // world])
    reduced = extra(tp(False), {"all_reduce": 2 * pairs}, activation)  # the output's, the input gradient's
    fsdp_call = extra(fsdp, {"all_gather": 2 * 2 * units, "reduce_scatter": 2 * units}, weight)  # 2 gathers, 1 reduce
    return {"tp:all_gather": gathered, "tp:reduce_scatter": gathered, "tp:all_reduce": reduced,
            "fsdp:all_gather": fsdp_call, "fsdp:reduce_scatter": fsdp_call}  # fmt: skip


def _ping_pong(x: torch.Tensor, rank: int, world: int) -> None:
    """A message to the neighbour and its answer (ranks paired 0-1, 2-3, ...; an odd one out waits)."""
    import torch.distributed as dist

    peer = rank ^ 1
    if peer >= world:
        return
    first, second = (dist.send, dist.recv) if rank % 2 == 0 else (dist.recv, dist.send)
    first(x, peer)
    second(x, peer)
