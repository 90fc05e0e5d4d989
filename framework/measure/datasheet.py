"""GPU peak FLOP/s from vendor datasheets: per part (form factor apart) and per compute dtype.

MFU divides by the peak of the arithmetic the run really does: bf16/fp16 tensor cores under
autocast, TF32 tensor cores for fp32 matmuls when `allow_tf32` is on (precision.tf32), plain
fp32 otherwise (on an H100 SXM, 989 vs 495 vs 67 TFLOP/s: judging an fp32 run against the bf16
peak understates its MFU 15-fold). Dense figures (no 2:4 sparsity), per GPU.

The same part comes in form factors with other clocks and power: an H100 PCIe or NVL is not an
H100 SXM, an H200 NVL not an H200 SXM; GH200 is the Grace Hopper superchip's H100-class GPU.
Device names as CUDA reports them: "NVIDIA H100 80GB HBM3" (SXM), "NVIDIA H100 PCIe",
"NVIDIA H100 NVL", "NVIDIA H200", "NVIDIA H200 NVL", "NVIDIA GH200 480GB", "NVIDIA A100-SXM4-80GB".
"""

from __future__ import annotations

import re

import torch

# part -> form factor ("" : the part's default, SXM where it has one) -> dtype -> dense TFLOP/s.
# A part without TF32 tensor cores (V100, T4) runs fp32 matmuls at its fp32 rate either way;
# without bf16 (V100, T4) it has no bf16 entry (autocast bf16 there is emulated: no peak).
PEAKS: dict[str, dict[str, dict[str, float]]] = {
    "GH200": {"": {"bf16": 989.0, "fp16": 989.0, "tf32": 494.7, "fp32": 66.9}},
    "H200": {
        "": {"bf16": 989.0, "fp16": 989.0, "tf32": 494.7, "fp32": 66.9},
        "NVL": {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0},
    },
    "H100": {
        "": {"bf16": 989.0, "fp16": 989.0, "tf32": 494.7, "fp32": 66.9},
        "PCIE": {"bf16": 756.5, "fp16": 756.5, "tf32": 378.0, "fp32": 51.2},
        "NVL": {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0},
    },
    "A100": {"": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}},
    "L40S": {"": {"bf16": 362.0, "fp16": 362.0, "tf32": 183.0, "fp32": 91.6}},
    "L40": {"": {"bf16": 181.0, "fp16": 181.0, "tf32": 90.5, "fp32": 90.5}},
    "A10G": {"": {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2}},
    "L4": {"": {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3}},
    "V100": {"": {"fp16": 125.0, "fp32": 15.7}},
}
FORMS = ("PCIE", "NVL")  # words of a device name that pick a form factor other than the default
# the parts (SXM) whose every figure the planner's GPU time model holds (framework.plan.gpu.SPECS)
PLANNED_PARTS = ("A100", "H100", "H200")

_DTYPE_KEYS = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def _words(name: str) -> set[str]:
    return set(re.split(r"[^A-Z0-9]+", name.upper()))


def part_of(name: str) -> tuple[str, str] | None:
    """(part, form factor) of a CUDA device name, or None for a part not in the table. Parts
    match as whole words ("L40" is not "L4", "GH200" not "H200"); "A100-SXM4-80GB" is an A100."""
    words = _words(name)
    part = next((p for p in sorted(PEAKS, key=len, reverse=True) if p in words), None)
    if part is None:
        return None
    form = next((f for f in FORMS if f in words and f in PEAKS[part]), "")
    return part, form


def compute_key(dtype: torch.dtype, tf32: bool) -> str:
    """The arithmetic a run's matmuls use: bf16, fp16, tf32 (fp32 with allow_tf32) or fp32."""
    key = _DTYPE_KEYS[dtype]
    return "tf32" if key == "fp32" and tf32 else key


def datasheet_tflops(name: str, dtype: torch.dtype = torch.bfloat16, tf32: bool = False) -> float | None:
    """Dense peak TFLOP/s of device `name` computing in `dtype` (fp32: TF32 when `tf32`, where
    the part has TF32 tensor cores), or None for an unknown part or a dtype it has no peak for."""
    found = part_of(name)
    if found is None:
        return None
    table = PEAKS[found[0]][found[1]]
    key = compute_key(dtype, tf32)
    if key == "tf32" and "tf32" not in table:
        key = "fp32"
    return table.get(key)


def is_planned_part(name: str) -> bool:
    """`name` is a part the planner's GPU time model knows (PLANNED_PARTS), or a CUDA device name
    of one: what `plan.gpu` may name."""
    found = part_of(str(name))
    return found is not None and not found[1] and found[0] in PLANNED_PARTS
