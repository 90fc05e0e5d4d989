"""The machine profile the planner times layouts with: per-rank peak FLOP/s, collective latency and
link bandwidth within and across nodes.

Measured once by a short probe and cached in ~/.cache/hydradist/links.json: the peak is the
matmul probe MFU uses (framework.measure.metrics), shared among the local ranks as training shares the
cores; the link is an all-reduce of a few sizes between `world` local workers on the backend,
fitted as seconds = latency + wire bytes / bandwidth. `plan.*` overrides any figure (a GPU
cluster: peak TFLOP/s, GB/s within and across nodes). Ranks started by a launcher (torchrun,
srun) neither probe nor read a cache for `parallel=auto`: they use the config or nominal
figures, so that every rank, on every node, decides alike.

A probe never starts more workers than one node of the planned job runs here (world / plan.nodes,
capped by this machine's cores or GPUs, `framework.machine.local_ranks`): planning 1,024 ranks on
a laptop probes a 2-rank link and says so. Each figure's source (config, probe, cache, datasheet,
nominal) is in `Profile.sources`.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch
from omegaconf import DictConfig

from framework.machine import cpu_name, local_ranks, usable_cores
from framework.plan.baseline import baseline_bytes, forks_workers
from framework.plan.cache import read_cache, write_cache
from framework.plan.gpu import (
    HOST_SHARE,
    NCCL_BASE_S,
    NCCL_NET_STEP_S,
    NCCL_NVLINK_STEP_S,
    GpuKernels,
    gpu_kernels,
    gpu_spec,
    probe_row,
    probed_part,
    refined,
)
from framework.plan.kernels import Kernels, probe_kernels
from framework.plan.link import probe_link
from framework.plan.ops import BACKWARD_OPS, count_ops

# figures for what is neither configured nor measured (ranks a launcher started: set plan.*)
NOMINAL = {"gbps": 10.0, "latency_us": 50.0, "cpu_tflops": 0.1, "gpu_tflops": 100.0,
           "op_overhead_us": {"cpu": 10.0, "cuda": 10.0}}  # fmt: skip
# CPU: glibc's retention beyond the live bytes, fitted (0.15 to 0.38, median 0.2) on the four
# runs of benchmarks/plan_peak.py (none, ddp x2, fsdp x4, pp x2 on the 100M gpt); CUDA: the
# caching allocator's usual few percent
NOMINAL_SLACK = {"cpu": 0.20, "cuda": 0.05}


@dataclass(frozen=True)
class Profile:
    peak_flops: float  # per rank
    intra_bytes_per_s: float
    inter_bytes_per_s: float
    latency_s: float
    overlap: float  # share of compute that hides data-parallel communication
    source: str  # where the figures came from
    baseline_bytes: int = 0  # the process before the model (the peak model's floor)
    slack: float = 0.0  # allocator retention, a share of the live bytes
    probe_ranks: int = 0  # the workers the link probe ran (0: none)
    sources: dict = None  # figure -> "config" | "probe" | "cache" | "datasheet" | "nominal"
    op_overhead_s: float = 0.0  # dispatch cost per operator (Python, autograd, the kernel launch)
    kernels: Kernels | None = None  # matmul, elementwise and optimizer costs (CPU: probed; else None)
    share: float = 1.0  # the share of its threads a rank gets (local ranks x threads over the cores)
    op_latency_s: dict = None  # collective -> seconds a call, back to back as training issues them (probed)
    op_bytes_per_s: dict = None  # collective -> its own wire bytes per second within a node (probed)
    step_latency_s: tuple[float, float] = (0.0, 0.0)  # per ring step (within a node, across nodes)
    host_bytes_per_s: float = 0.0  # pinned copies to and from the host (0: the host is the device)

    def latency_of(self, op: str) -> float:
        """Seconds a call of `op` ("all_gather", or "fsdp:all_gather" as FSDP issues it) takes
        beyond its bytes: the probed figure of the caller, else of the bare collective."""
        by_op = self.op_latency_s or {}
        return by_op.get(op, by_op.get(op.rpartition(":")[2], self.latency_s))

    def bandwidth_of(self, op: str, spans_nodes: bool = False) -> float:
        """Wire bytes per second of `op` ("fsdp:all_gather" as "all_gather") within a node (the
        probed figure of that collective, else the link's), or across nodes."""
        if spans_nodes:
            return self.inter_bytes_per_s
        return (self.op_bytes_per_s or {}).get(op.rpartition(":")[2], self.intra_bytes_per_s)


def _link_key(device: str, backend: str, world: int) -> str:
    name = torch.cuda.get_device_name(0) if device == "cuda" else cpu_name()
    return f"{name}|{device}|{backend}|world={world}|torch={torch.__version__}|paths=small-layers|bandwidth-by-op"


MEASURES = ("probe", "cache", "config")  # ever fewer figures from this machine (plan.profile's choices)


def machine_profile(cfg: DictConfig, world: int, measure: str = "probe") -> Profile:
    """The profile for `world` ranks. `plan.*` figures always come first; for the rest:
    - measure="probe": the cache, else a fresh measurement (cached);
    - measure="cache": the cache, else nominal figures (a run checking its own prediction);
    - measure="config": nominal figures only, so that every rank a launcher started (on any
      node, whatever its cache holds) ranks the layouts alike.
    `plan.profile` can only narrow `measure` (config: nominal wherever the profile is asked for).
    `source` says which was used, `sources` figure by figure."""
    from framework.config import resolve_device

    rows = probe_rows(cfg)
    if cfg.plan.get("gpu") or rows:
        return gpu_profile(cfg, cfg.plan.gpu or probed_part(rows) or "", rows)
    measure = max(measure, str(cfg.plan.get("profile", "probe")), key=MEASURES.index)
    device = resolve_device(cfg)
    if device != "cuda" and cfg.plan.get("gpu_power_w") is not None:
        from framework.config import ConfigError

        raise ConfigError("plan.gpu_power_w", "a GPU's power limit: set plan.gpu (A100, H100, H200) too")
    local = local_ranks(world, cfg.plan.nodes, cfg.launch.nproc_per_node, device)
    plan, sources, where = cfg.plan, [], {}
    peak = _peak(cfg, device, local, sources, measure)
    where["peak_flops"] = sources[-1].split(": ")[1]
    link, probed = _link(cfg, device, local, measure, sources)
    where["link"] = "probe" if probed else ("cache" if link else "nominal")
    link = link or {"bytes_per_s": NOMINAL["gbps"] * 1e9, "latency_s": NOMINAL["latency_us"] * 1e-6}
    intra = plan.intra_node_gbps * 1e9 if plan.intra_node_gbps is not None else link["bytes_per_s"]
    inter = plan.inter_node_gbps * 1e9 if plan.inter_node_gbps is not None else intra
    latency = plan.latency_us * 1e-6 if plan.latency_us is not None else link["latency_s"]
    by_op = link.get("by_op") if plan.latency_us is None else None
    bandwidth_by_op = link.get("bytes_per_s_by_op") if plan.intra_node_gbps is None else None
    where |= {
        "intra_bytes_per_s": "config" if plan.intra_node_gbps is not None else where["link"],
        "inter_bytes_per_s": "config" if plan.inter_node_gbps is not None else "as intra",
        "latency_s": "config" if plan.latency_us is not None else where.pop("link"),
    }
    where.pop("link", None)
    overlap = plan.overlap if plan.overlap is not None else (0.8 if device == "cuda" else 0.0)
    where["overlap"] = "config" if plan.overlap is not None else "nominal"
    baseline, where["baseline_bytes"] = baseline_bytes(device, measure, forks_workers(cfg, world))
    overhead, where["op_overhead_s"] = op_overhead(cfg, device, local, measure)
    kernels, where["kernels"] = kernel_costs(cfg, device, local, measure, overhead)
    cores = usable_cores()
    share = 1.0 if device == "cuda" else min(1.0, cores / (max(1, cores // local) * local))
    return Profile(
        peak, intra, inter, latency, overlap, "; ".join(sources), baseline, NOMINAL_SLACK[device],
        local if probed else 0, where, overhead, kernels, share, by_op, bandwidth_by_op,
    )  # fmt: skip


def kernel_costs(
    cfg: DictConfig, device: str, local: int, measure: str, overhead_s: float
) -> tuple[Kernels | None, str]:
    """(this machine's kernel costs on the threads one of `local` ranks gets, source): CPU only,
    from the cache or a probe (framework.plan.kernels, with the in-situ factor of
    framework.plan.calibrate at `overhead_s` per operator); None where neither may run."""
    from framework.plan.calibrate import in_situ_factor
    from framework.precision import DTYPES

    if device == "cuda":
        spec = gpu_spec(torch.cuda.get_device_name(0))
        return (None, "none") if spec is None else (_gpu_kernels(cfg, spec), "datasheet")
    if measure == "config":
        return None, "none"
    threads = max(1, usable_cores() // local)
    dtype = DTYPES[cfg.precision.name]
    key = f"kernels|{cpu_name()}|threads={threads}|{dtype}|torch={torch.__version__}|orientations|byte-kinds|in-situ"
    cached = read_cache().get(key)
    if cached is not None:
        return Kernels.from_json(cached), "cache"
    if measure != "probe":
        return None, "none"
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        kernels = probe_kernels(dtype)
        kernels = dataclasses.replace(kernels, in_situ=in_situ_factor(kernels, overhead_s, dtype))
    finally:
        torch.set_num_threads(before)
    write_cache(key, kernels.to_json())
    return kernels, "probe"


def op_overhead(cfg: DictConfig, device: str, local: int, measure: str) -> tuple[float, str]:
    """(seconds of dispatch per operator, source): a tiny pre-norm block's forward and backward,
    whose time is all overhead, over the operators its traced forward dispatches and their
    backward (framework.plan.ops counts them as the time model does); on the threads one of
    `local` ranks gets. Cached per machine."""
    if cfg.plan.get("op_overhead_us") is not None:
        return cfg.plan.op_overhead_us * 1e-6, "config"
    if measure == "config" or device == "cuda":
        return NOMINAL["op_overhead_us"][device] * 1e-6, "nominal"
    threads = max(1, usable_cores() // local)
    key = f"op_overhead|{cpu_name()}|threads={threads}|torch={torch.__version__}|traced"
    cached = read_cache().get(key)
    if cached is not None:
        return cached["s"], "cache"
    if measure != "probe":
        return NOMINAL["op_overhead_us"][device] * 1e-6, "nominal"
    seconds, forward_ops = _time_tiny_block(threads)
    value = seconds / (forward_ops * (1 + BACKWARD_OPS))
    write_cache(key, {"s": value})
    return value, "probe"


def _time_tiny_block(threads: int, iters: int = 60) -> tuple[float, int]:
    import statistics

    from torch import nn
    from torch.nn import functional as F

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    norm1, norm2 = nn.LayerNorm(16), nn.LayerNorm(16)
    qkv, proj, up, down = nn.Linear(16, 48), nn.Linear(16, 16), nn.Linear(16, 64), nn.Linear(64, 16)
    x = torch.randn(1, 8, 16, requires_grad=True)

    def forward(x):
        q, k, v = qkv(norm1(x)).view(1, 8, 3, 2, 8).permute(2, 0, 3, 1, 4)
        h = x + proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(1, 8, 16))
        return h + down(F.gelu(up(norm2(h))))

    times = []
    try:
        for _ in range(iters):
            t0 = time.perf_counter()
            forward(x).sum().backward()
            times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(before)
    return statistics.median(times[5:]), count_ops(lambda: forward(x.detach()))


def _link(cfg: DictConfig, device: str, local: int, measure: str, sources: list[str]) -> tuple[dict | None, bool]:
    """(the link figures of `local` ranks from the cache or a probe, or None; whether it probed)."""
    if cfg.plan.intra_node_gbps is not None and cfg.plan.latency_us is not None:
        return None, False
    backend = "nccl" if device == "cuda" else "gloo"
    key = _link_key(device, backend, local)
    link = read_cache().get(key) if measure != "config" else None
    probed = False
    if link is None and measure == "probe" and local > 1:
        link, probed = probe_link(local, device), True
        write_cache(key, link)
    sources.append(f"link: {key if link else 'nominal'}")
    return link, probed


def _peak(cfg: DictConfig, device: str, local: int, sources: list[str], measure: str) -> float:
    from framework.measure.metrics import cpu_peak_flops, gpu_peak_tflops
    from framework.precision import DTYPES

    tflops = cfg.plan.peak_tflops or cfg.metrics.peak_tflops
    if tflops is not None:
        sources.append("peak: config")
        return tflops * 1e12
    if device == "cuda":
        # the run's compute dtype: bf16/fp16 tensor cores, or fp32 matmuls on TF32 (precision.tf32) or not
        dtype = DTYPES[cfg.precision.name]
        tflops = gpu_peak_tflops(torch.cuda.get_device_name(0), dtype, cfg.precision.tf32) or NOMINAL["gpu_tflops"]
        sources.append("peak: datasheet")
        return tflops * 1e12
    if measure == "config":
        sources.append("peak: nominal")
        return NOMINAL["cpu_tflops"] * 1e12
    # CPU ranks share the cores as training does: threads = cores // local ranks each
    cores = usable_cores()
    threads, before = max(1, cores // local), torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        flops = cpu_peak_flops(DTYPES[cfg.precision.name])
    finally:
        torch.set_num_threads(before)
    sources.append("peak: cpu probe")
    return flops * min(1.0, cores / (threads * local))


def probe_rows(cfg: DictConfig) -> dict | None:
    """`plan.profile=<rows.jsonl>`: the probe row's data of benchmarks/gpu.sh's file, else None."""
    measure = str(cfg.plan.get("profile", "probe"))
    return None if measure in MEASURES else probe_row(measure)


def gpu_profile(cfg: DictConfig, part: str, rows: dict | None = None) -> Profile:
    """The profile of a GPU cluster from the part's published figures (framework.plan.gpu), on any
    machine: no probe, no cache; `plan.*` figures still come first. `rows`: a probe row's data
    (gpu.sh on a device of the part), whose matmul and copy rates replace the published ones."""
    from framework.config import ConfigError
    from framework.measure.datasheet import PLANNED_PARTS, is_planned_part

    if not is_planned_part(part):  # validate says the same of plan.gpu; a device's own name lands here
        raise ConfigError("plan.gpu", f"{part!r} is not a part the time model knows; one of {', '.join(PLANNED_PARTS)}")
    spec = refined(gpu_spec(part), rows) if rows else gpu_spec(part)
    plan = cfg.plan
    kernels = _gpu_kernels(cfg, spec)
    intra, inter = spec.link_bytes_per_s()
    where = {"peak_flops": "config" if plan.peak_tflops else "datasheet", "kernels": "probe row" if rows else "datasheet",
             "overlap": "config" if plan.overlap is not None else "nominal", "baseline_bytes": "nominal"}  # fmt: skip

    def given(key: str, figure: str, default: float, scale: float) -> float:
        """`plan.<key>` in the Profile's unit, else the part's figure; its source under the
        Profile's name of it (`figure`), as the planner's machine line reads them."""
        where[figure] = "config" if plan.get(key) is not None else "datasheet"
        return plan[key] * scale if plan.get(key) is not None else default

    intra = given("intra_node_gbps", "intra_bytes_per_s", intra, 1e9)
    inter = given("inter_node_gbps", "inter_bytes_per_s", inter, 1e9)
    latency = given("latency_us", "latency_s", NCCL_BASE_S, 1e-6)
    overhead = given("op_overhead_us", "op_overhead_s", 0.0, 1e-6)
    overlap = plan.overlap if plan.overlap is not None else 0.8
    return Profile(
        kernels.peak_flops, intra, inter, latency, overlap, f"gpu: {spec.part} (published figures)", 0,
        NOMINAL_SLACK["cuda"], 0, where, overhead, kernels, 1.0, None, None, (NCCL_NVLINK_STEP_S, NCCL_NET_STEP_S),
        spec.host_gb_s * 1e9 * HOST_SHARE,
    )  # fmt: skip


def _gpu_kernels(cfg: DictConfig, spec) -> GpuKernels:
    from framework.measure.datasheet import datasheet_tflops
    from framework.precision import DTYPES

    dtype = DTYPES[cfg.precision.name]
    tflops = cfg.plan.peak_tflops or cfg.metrics.peak_tflops or datasheet_tflops(spec.part, dtype, cfg.precision.tf32)
    return gpu_kernels(spec, tflops * 1e12, dtype, cfg.plan.get("gpu_power_w"))
