"""The peak-memory model: the most bytes one rank holds at once (CPU: resident set; CUDA: the
allocator's peak), what decides whether a layout fits.

    peak = baseline + parameters + optimizer state + persistent buffers + gathered parameters
           + max(saved activations + the head's transients, gradients + the update's temporaries)
           + allocator slack

- baseline: the process before the model (imports, the backend; CPU only, as CUDA's allocator
  counts from zero), measured once per device kind (`profile.baseline_bytes`);
- saved activations at the schedule's peak and FSDP's gathered units (the one running and the
  prefetched one, or all of them without resharding): `framework.plan.activations`;
- persistent buffers: DDP's gradient buckets (allocated at wrapping and kept between steps;
  under `gradient_as_bucket_view` the gradients are views into them, not a second copy);
- backward frees saved activations block by block while it produces gradients, so at most one of
  the two is whole; the head's transients (the logits' gradient) come at its start, FSDP's
  reduce-scatter input (one unit's unsharded gradient, in the reduce dtype) at each unit's end;
- slack: what the allocator keeps beyond the live bytes, a share measured on this machine
  (`profile.slack`).

On CUDA the allocator's reserved peak (`torch.cuda.max_memory_reserved`, what torchtitan's tables
publish) is more by the cached blocks that nothing live at the peak can use (`cached_bytes`).
"""

from __future__ import annotations

import math

from omegaconf import DictConfig

from framework.plan.activations import host_apart, micro_batch, tokens_per_rank
from framework.plan.model import Layout, Shapes

PARTS = ("baseline", "state", "buffers", "gathered", "transient", "slack")


def persistent_buffers(shapes: Shapes, cfg: DictConfig, layout: Layout) -> int:
    """DDP's buckets: one flat fp32 buffer per bucket, every gradient's size in all."""
    if layout.name != "ddp" or layout.world < 2:
        return 0
    return 4 * sum(math.prod(p.shape) for p in shapes.params)


def head_transient(shapes: Shapes, cfg: DictConfig, layout: Layout) -> int:
    """The logits' gradient and the log-softmax's (fp32, b x T x vocab) at the start of backward."""
    if shapes.gpt is None:
        return 0
    vocab = shapes.gpt["vocab_size"] // (layout.tp if layout.loss_parallel else 1)
    return 2 * 4 * micro_batch(cfg, layout) * tokens_per_rank(cfg, layout) * vocab


def cached_bytes(shapes: Shapes, cfg: DictConfig, layout: Layout) -> int:
    """CUDA's reserved peak beyond the allocated one: blocks the caching allocator keeps that no
    tensor live at the peak can take. FSDP's all-gather output of its largest unit (allocated on
    FSDP's copy-in stream, torch's _fsdp_collectives.foreach_all_gather; freed once copied out
    into the parameters, its block stays in that stream's pool, which the default stream's tensors
    cannot use); the forward's 16-bit logits (freed by the peak at the start of backward, where
    every tensor the loss allocates is fp32, twice its size: none fits its block). 0 on a CPU."""
    if shapes.gpt is None or not host_apart(cfg):
        return 0
    size = 4 if cfg.precision.name == "fp32" else 2
    logits = 0
    if size == 2 and layout.fsdp:  # under FSDP's mixed precision the head outputs 16 bits
        vocab = shapes.gpt["vocab_size"] // (layout.tp if layout.loss_parallel else 1)
        logits = 2 * micro_batch(cfg, layout) * tokens_per_rank(cfg, layout) * vocab
    gathered = size * max(_units(shapes, layout).values()) if layout.fsdp and layout.shard > 1 else 0
    return logits + gathered


def _units(shapes: Shapes, layout: Layout) -> dict[str, int]:
    """FSDP's units: elements each gathers on a rank (whole over the shards, 1/tp)."""
    units: dict[str, int] = {}
    for p in shapes.params:
        units[p.unit] = units.get(p.unit, 0) + math.prod(p.shape) // layout.tp
    return units


def reduce_buffer(shapes: Shapes, cfg: DictConfig, layout: Layout) -> int:
    """FSDP: one unit's unsharded gradient, the reduce-scatter's input (the largest unit)."""
    if not layout.fsdp or layout.shard < 2:
        return 0
    return 4 * max(_units(shapes, layout).values())


def peak_parts(shapes: Shapes, cfg: DictConfig, layout: Layout, memory: dict, profile) -> dict[str, int] | None:
    """The peak taken apart (bytes), or None where saved activations are not predicted."""
    if memory.get("activation_bytes") is None:
        return None
    params, grads, optim = memory["param_bytes"], memory["grad_bytes"], memory["optim_bytes"]
    backward = memory["activation_bytes"] + head_transient(shapes, cfg, layout)
    buffers = persistent_buffers(shapes, cfg, layout)
    if buffers and cfg.parallel.get("gradient_as_bucket_view", True):
        grads = 0  # the gradients are views into DDP's buckets: counted there
    update = grads + reduce_buffer(shapes, cfg, layout)
    live = {
        "baseline": profile.baseline_bytes,
        "state": params + optim,
        "buffers": buffers,
        "gathered": memory.get("gathered_bytes") or 0,
        "transient": max(backward, update),
    }
    live["slack"] = round(profile.slack * (sum(live.values()) - live["baseline"]))
    return live
