"""A GPU's time model, from published figures: the planner prices a layout on a GPU it cannot run on
(`plan.gpu=A100`, from a laptop) or on the CUDA device it runs on, with the same interface as the
CPU's probed kernels (framework.plan.kernels.Kernels), so the trace of the model's forward
(framework.plan.ops) is priced operator by operator either way.

- **Matmuls** at the best rate measured for the part's dense bf16/fp16 GEMMs (its MAMF, "maximum
  achievable matmul FLOPS"), not its datasheet peak, times two losses that depend on the shape
  (NVIDIA's "Matrix Multiplication Background User's Guide", its sections on tile and wave
  quantization): the output is cut into 256 x 128 tiles, one per SM at a time, so a partial last
  tile (tile quantization) and a partial last wave of tiles over the SMs (wave quantization)
  cost a whole one; an output of fewer tiles than SMs splits its reduction (split-K) to fill
  them. A matmul too small for its FLOPs to dominate is bound by moving its operands through HBM.
- **Attention** (FlashAttention-2, SDPA's kernel on these parts) at the part's share of the peak,
  over the scores a causal mask leaves (FlashAttention skips the blocks above the diagonal).
- **Power.** A power limit below the part's TDP lowers the clocks the matmuls and attention run
  at: their rates scale by (limit / TDP) ** POWER_EXPONENT (`plan.gpu_power_w`, default the TDP).
- **Everything else** (norms, activations, residual adds, casts, the optimizer's update) is
  memory-bound on a GPU: its bytes at HBM_SHARE of the datasheet's bandwidth.
- **Links** (framework.plan.timing.comm_s): NVLink within a node and one NIC per GPU across
  nodes (DGX/HGX), at the share of line rate NCCL reaches, with NCCL's own latency model: a base
  per call and a latency per ring step, NVLink's or the network's.

Sources of the constants (none fitted to the tables the planner is checked against):
- FP8: the datasheets' dense FP8 (E4M3) tensor-core peak, twice the dense bf16's on Hopper (H100 and
  H200 SXM: 1,979 of 989 TFLOP/s); an A100 has no FP8 units. A converter's matmuls in "fp8" run
  at the measured bf16 rate times that ratio (GpuKernels.format_share); a part without: emulated,
  at its 16-bit rate (framework/plan/convert.py).
- MAMF: stas00/ml-engineering's mamf-finder, as tabled in mag-/gpu_benchmark's README: A100 SXM
  267.9 TFLOP/s (of 312), H100 SXM 792.1 (of 989). The H200 has the H100's SMs and clocks.
- HBM: 88% of the datasheet, the most a read kernel reached on an A100 80GB SXM (1.80 of
  2.04 TB/s, NVIDIA developer forums, "Trouble to Reach Peak Bandwidth of A100", which quotes a
  GTC talk's ~90% as the best any kernel reached).
- Attention: FlashAttention-2 (Dao, 2023) reaches 50-73% of the A100's peak; the middle, 0.6. On
  Hopper it reaches "only 35% utilization" (Shah et al. 2024, FlashAttention-3, its abstract).
- TDP: NVIDIA's datasheets (A100 SXM 400 W, H100 and H200 SXM 700 W); the least limit
  nvidia-smi takes on these parts (`-pl`): 100 W (A100), 200 W (H100, H200).
- POWER_EXPONENT is the one fitted constant: on torchtitan's Table 1 FSDP row (Llama 3.1 8B,
  8 H100s at 500 W, 5,762 tokens/s per GPU) alone, its selective "op" checkpointing planned as
  memory=selective memory.matmul_every=2, checked on every other H100 row of
  benchmarks/plan_h100.py (docs/results/plan_h100.md).
- NVLink: NCCL's maintainer in NVIDIA/nccl-tests#212: "450GB/s is the line rate. With the
  protocol overhead (~20%) NCCL can get an effective NVLink bandwidth of 370GB/s" (H100), a
  share of 370/450 applied to every part (A100 reports in nccl-tests#149 and #178: 200-208 GB/s).
- PCIe to the host (activation offload's copies): 80% of line rate, what pinned copies reach in
  CUDA's bandwidthTest (about 25 GB/s of an A100's gen4 x16, about 50 of an H100's gen5 x16).
- InfiniBand: 90% of line rate (NVIDIA/nccl-tests#119: 85-96 of 100 GB/s per node of 4 HDR NICs).
- Latency: NCCL's tuning model (src/graph/tuning.cc, ring, Simple protocol): 8.4 us a call,
  3.4 us a step over NVLink, 14 us over the network.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

HBM_SHARE = 0.88
NVLINK_SHARE = 370 / 450
NIC_SHARE = 0.90
HOST_SHARE = 0.8  # pinned copies over PCIe (CUDA's bandwidthTest: about 25 of gen4's 31.5 GB/s)
ATTENTION_SHARE = 0.6  # FlashAttention-2 on an A100 (Hopper: GpuSpec.attention_share)
CAUSAL_SHARE = 0.5  # of a causal mask's scores that FlashAttention computes (its diagonal blocks aside)
POWER_EXPONENT = 1.22  # fitted (above): matmul rate ~ (power limit / TDP) ** this
TILE = (256, 128)  # an output tile per SM (cuBLAS's largest for 16-bit GEMMs on these parts)
SPLIT_K_DEPTH = 512  # the least of the reduction a split-K slice keeps
NCCL_BASE_S, NCCL_NVLINK_STEP_S, NCCL_NET_STEP_S = 8.4e-6, 3.4e-6, 14e-6
# AdamW's update (foreach or fused) per parameter, fp32 state: read the parameter, its gradient
# and both moments, write the parameter and both moments (28 bytes); clipping reads the gradient
# and scales it in place (12); zeroing writes it (4)
OPTIMIZER_BYTES = 44


@dataclass(frozen=True)
class GpuSpec:
    part: str
    sms: int
    hbm_tb_s: float  # the datasheet's HBM bandwidth
    nvlink_gb_s: float  # per GPU and direction, line rate
    nic_gb_s: float  # per GPU across nodes, line rate (one NIC per GPU)
    mamf_tflops: float  # the best dense 16-bit matmul rate measured
    memory_gb: float  # HBM per GPU
    host_gb_s: float = 31.5  # PCIe to the host, per direction, line rate (gen4 x16; gen5: 63)
    tdp_w: float = 400.0  # the datasheet's board power, the default limit
    min_power_w: float = 100.0  # the least power limit the driver takes
    attention_share: float = ATTENTION_SHARE  # FlashAttention-2's share of the 16-bit peak
    fp8_tflops: float | None = None  # the datasheet's dense FP8 peak (None: no FP8 units)

    def link_bytes_per_s(self) -> tuple[float, float]:
        """(within a node, across nodes) bytes per second a collective's ring moves per GPU."""
        return self.nvlink_gb_s * 1e9 * NVLINK_SHARE, self.nic_gb_s * 1e9 * NIC_SHARE


# SXM parts of DGX/HGX nodes: A100 80GB (HDR 200 Gb/s per GPU), H100 and H200 (NDR 400 Gb/s)
SPECS = {
    "A100": GpuSpec("A100", 108, 2.039, 300.0, 25.0, 267.9, 80.0),
    "H100": GpuSpec("H100", 132, 3.35, 450.0, 50.0, 792.1, 80.0, 63.0, 700.0, 200.0, 0.35, fp8_tflops=1979.0),
    "H200": GpuSpec("H200", 132, 4.8, 450.0, 50.0, 792.1, 141.0, 63.0, 700.0, 200.0, 0.35, fp8_tflops=1979.0),
}


def gpu_spec(name: str) -> GpuSpec | None:
    """The spec of a part ("A100") or CUDA device name ("NVIDIA A100-SXM4-80GB"), or None."""
    from framework.measure.datasheet import part_of

    found = part_of(name)
    return SPECS.get(found[0]) if found and not found[1] else None


@dataclass(frozen=True)
class GpuKernels:
    """framework.plan.kernels.Kernels's interface, priced from a GpuSpec at a compute peak."""

    spec: GpuSpec
    peak_flops: float  # the datasheet's, for the run's compute dtype
    itemsize: int = 2
    in_situ: float = 1.0
    clock: float = 1.0  # the matmul and attention rates' share left at the power limit (power_share)
    causal_share: float = CAUSAL_SHARE  # framework.plan.timing prices a causal trace's attention at it

    @property
    def bytes_per_s(self) -> float:
        return self.spec.hbm_tb_s * 1e12 * HBM_SHARE

    @property
    def math_bytes_per_s(self) -> float:  # norms and activations are memory-bound on a GPU too
        return self.bytes_per_s

    @property
    def optimizer_s_per_param(self) -> float:
        return OPTIMIZER_BYTES / self.bytes_per_s

    @property
    def matmul_flops(self) -> float:
        """The best matmul rate: the measured MAMF's share of the 16-bit peak, at this dtype's peak."""
        return self.clock * self.peak_flops * self.spec.mamf_tflops / _peak_16bit(self.spec)

    def matmul_s(self, m: float, k: float, n: float, orientation: str = "forward") -> float:
        """Seconds of the (m, k) by (k, n) product in `orientation`: the forward's output is
        (m, n) over k, the input's gradient (m, k) over n, the weight's (n, k) over m."""
        if m <= 0 or k <= 0 or n <= 0:
            return 0.0
        rows, cols, depth = {"forward": (m, n, k), "input_grad": (m, k, n), "weight_grad": (n, k, m)}[orientation]
        compute = 2 * m * k * n / (self.matmul_flops * _tiling(rows, cols, depth, self.spec.sms))
        memory = self.itemsize * (m * k + k * n + m * n) / self.bytes_per_s
        return max(compute, memory)

    def attention_s(self, m: float, k: float, n: float) -> float:
        """Seconds of attention's forward for scores of shape (m, n) over head dim k."""
        return 4 * m * k * n / (self.clock * self.peak_flops * self.spec.attention_share)

    def format_share(self, fmt: str | None) -> float:
        """A matmul in `fmt` ("fp8") against one in the 16-bit compute dtype: the datasheets'
        peaks' ratio where the part has units for it, else 1 (emulated: the 16-bit matmul)."""
        if fmt == "fp8" and self.spec.fp8_tflops and self.itemsize == 2:
            return self.spec.fp8_tflops / _peak_16bit(self.spec)
        return 1.0


def _peak_16bit(spec: GpuSpec) -> float:
    from framework.measure.datasheet import PEAKS

    return PEAKS[spec.part][""]["bf16"]


def _tiling(rows: float, cols: float, depth: float, sms: int) -> float:
    """The share of the SMs' time a (rows, cols) output over `depth` uses: useful tile area over
    the padded tiles, times the busy share of the last wave, with split-K where tiles are few."""
    best = 0.0
    for tm, tn in (TILE, TILE[::-1]):
        tiles = math.ceil(rows / tm) * math.ceil(cols / tn)
        split = max(1, min(sms // tiles, int(depth // SPLIT_K_DEPTH))) if tiles < sms else 1
        waves = math.ceil(tiles * split / sms)
        busy = tiles * split / (waves * sms)
        best = max(best, busy * rows * cols / (tiles * tm * tn))
    return best


def power_share(spec: GpuSpec, watts: float | None) -> float:
    """The share of its matmul rate a part keeps under a power limit of `watts` (None: its TDP)."""
    if watts is None:
        return 1.0
    from framework.config import ConfigError

    if not spec.min_power_w <= watts <= spec.tdp_w:
        raise ConfigError(
            "plan.gpu_power_w",
            f"got {watts:g}; an {spec.part}'s power limit is {spec.min_power_w:g} to {spec.tdp_w:g} W (its TDP), "
            "or null: the TDP",
        )
    return (watts / spec.tdp_w) ** POWER_EXPONENT


def gpu_kernels(spec: GpuSpec, peak_flops: float, dtype: torch.dtype, watts: float | None = None) -> GpuKernels:
    return GpuKernels(spec, peak_flops, torch.empty((), dtype=dtype).element_size(), clock=power_share(spec, watts))


def probe_row(path: str) -> dict:
    """The probe row of `benchmarks/gpu.sh`'s rows.jsonl (`plan.profile=<rows.jsonl>`): its data
    (matmul_tflops, copy_gb_per_s, nvidia_smi), or a ConfigError naming plan.profile."""
    import json
    from pathlib import Path

    from framework.config import ConfigError

    try:
        lines = Path(path).read_text().splitlines()
        rows = [json.loads(line) for line in lines if line.strip()]
    except (OSError, ValueError) as err:
        raise ConfigError("plan.profile", f"cannot read {path!r} as gpu.sh's rows.jsonl: {err}") from None
    found = [r.get("data") or {} for r in rows if r.get("row") == "probe" and r.get("status") == "ok"]
    if not found or not {"matmul_tflops", "copy_gb_per_s"} <= set(found[-1]):
        raise ConfigError("plan.profile", f"{path!r} holds no probe row that ran (bash benchmarks/gpu.sh --rows probe)")
    return found[-1]


def probed_part(data: dict) -> str | None:
    """The part the probe ran on, from its nvidia-smi line ("NVIDIA H100 80GB HBM3, 550.54, ...")."""
    name = (data.get("nvidia_smi") or "").split(",")[0].strip()
    return name or None


def refined(spec: GpuSpec, data: dict) -> GpuSpec:
    """`spec` with the probe's own rates: its bf16 matmul (an 8192^3 product: the part's best
    rate, MAMF's role) and its device copy (bytes read and written a second: HBM's achievable
    rate, which GpuKernels reads as hbm_tb_s x HBM_SHARE)."""
    from dataclasses import replace

    return replace(spec, mamf_tflops=data["matmul_tflops"], hbm_tb_s=data["copy_gb_per_s"] / 1e3 / HBM_SHARE)
